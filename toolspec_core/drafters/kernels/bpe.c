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
 * ``tokenize`` runs a whole schema candidate through the boundary tokenizer's steps in one call
 * (its text runs at their boundaries with the context's tail, raw ids, each token's label), calling
 * back only the tokenizer's decode of a tail and its encode of text the encoder does not cover.
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

/* The ids of ``text`` (a new tuple), Py_None (new reference) where it is not covered, NULL on error. */
static PyObject *encode_text(const Bpe *b, PyObject *text) {
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

/* encode(bpe, text: str): the ids (a tuple), or None where the text is not covered. */
static PyObject *encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule, *text;
    if (!PyArg_ParseTuple(args, "OU", &capsule, &text)) return NULL;
    Bpe *b = PyCapsule_GetPointer(capsule, "toolspec_bpe");
    if (!b) return NULL;
    return encode_text(b, text);
}

/* The ids of ``text`` as a tuple: the compiled encoder's, or ``fallback(text)``'s where it does
 * not cover the text (the tokenizer's own encode). New reference, NULL on error. */
static PyObject *encode_or(const Bpe *b, PyObject *text, PyObject *fallback) {
    PyObject *ids = encode_text(b, text);
    if (ids != Py_None) return ids;
    Py_DECREF(ids);
    PyObject *r = PyObject_CallOneArg(fallback, text);
    if (!r) return NULL;
    PyObject *t = PySequence_Tuple(r);
    Py_DECREF(r);
    return t;
}

/* Whether the first k items of the tuple ``ids`` equal the k items of ``tail`` (a tuple). */
static int starts_with(PyObject *ids, PyObject *tail, Py_ssize_t k) {
    if (PyTuple_GET_SIZE(ids) < k) return 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(ids, i), PyTuple_GET_ITEM(tail, i), Py_EQ);
        if (eq <= 0) return eq;
    }
    return 1;
}

/* BoundaryTokenizer.continuation: the ids that follow the context ``ctx`` (a list of ids) when
 * ``text`` is written next -- tokenized with the longest of its last ``tail_tokens`` tokens that
 * decodes to whole characters (``decode(tuple) -> str``) and re-tokenizes to itself, else alone.
 * A new list, NULL on error. */
static PyObject *continuation(const Bpe *b, PyObject *ctx, PyObject *text, Py_ssize_t tail_tokens,
                              PyObject *decode, PyObject *fallback) {
    Py_ssize_t n = PyList_GET_SIZE(ctx);
    for (Py_ssize_t k = tail_tokens < n ? tail_tokens : n; k > 0; k--) {
        PyObject *slice = PyList_GetSlice(ctx, n - k, n);
        if (!slice) return NULL;
        PyObject *tail = PyList_AsTuple(slice);
        Py_DECREF(slice);
        if (!tail) return NULL;
        PyObject *tail_text = PyObject_CallOneArg(decode, tail);
        if (!tail_text) {
            Py_DECREF(tail);
            return NULL;
        }
        if (!PyUnicode_Check(tail_text)) {
            PyErr_SetString(PyExc_TypeError, "decode must return str");
            Py_DECREF(tail);
            Py_DECREF(tail_text);
            return NULL;
        }
        Py_ssize_t bad = PyUnicode_FindChar(tail_text, 0xFFFD, 0, PyUnicode_GET_LENGTH(tail_text), 1);
        if (bad == -2) {
            Py_DECREF(tail);
            Py_DECREF(tail_text);
            return NULL;
        }
        if (bad >= 0) { /* a split multi-byte character: not a clean boundary */
            Py_DECREF(tail);
            Py_DECREF(tail_text);
            continue;
        }
        PyObject *full = PyUnicode_Concat(tail_text, text);
        Py_DECREF(tail_text);
        if (!full) {
            Py_DECREF(tail);
            return NULL;
        }
        PyObject *ids = encode_or(b, full, fallback);
        Py_DECREF(full);
        if (!ids) {
            Py_DECREF(tail);
            return NULL;
        }
        int same = starts_with(ids, tail, k);
        Py_DECREF(tail);
        if (same < 0) {
            Py_DECREF(ids);
            return NULL;
        }
        if (same) {
            PyObject *rest = PyTuple_GetSlice(ids, k, PyTuple_GET_SIZE(ids));
            Py_DECREF(ids);
            if (!rest) return NULL;
            PyObject *out = PySequence_List(rest);
            Py_DECREF(rest);
            return out;
        }
        Py_DECREF(ids);
    }
    PyObject *ids = encode_or(b, text, fallback);
    if (!ids) return NULL;
    PyObject *out = PySequence_List(ids);
    Py_DECREF(ids);
    return out;
}

/* A token's characters: ``chars[token]`` or, on a miss, ``chars_of(token)`` (which fills the dict); -1 on error. */
static long long token_chars(PyObject *t, PyObject *chars, PyObject *chars_of) {
    PyObject *c = PyDict_GetItemWithError(chars, t);
    long long nc;
    if (c) {
        nc = PyLong_AsLongLong(c);
    } else {
        if (PyErr_Occurred()) return -1;
        PyObject *r = PyObject_CallOneArg(chars_of, t);
        if (!r) return -1;
        nc = PyLong_AsLongLong(r);
        Py_DECREF(r);
    }
    return nc;
}

/* tokenize(bpe, tail, segs, tail_tokens, decode, fallback, chars, chars_of):
 * BoundaryTokenizer.tokenize in one call -- a candidate's segments written after ``tail`` (a
 * tuple of ids): runs of text segments each tokenized at its boundary (``continuation``, the
 * context being ``tail`` and the ids so far), raw id segments as they are; each text token
 * labelled by the first segment of its run ending after its first character (the run's last
 * segment past the end). (ids, labels), two tuples. */
static PyObject *tokenize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule, *tail, *segs, *decode, *fallback, *chars, *chars_of;
    Py_ssize_t tail_tokens;
    if (!PyArg_ParseTuple(args, "OOOnOOO!O", &capsule, &tail, &segs, &tail_tokens, &decode, &fallback,
                          &PyDict_Type, &chars, &chars_of))
        return NULL;
    Bpe *b = PyCapsule_GetPointer(capsule, "toolspec_bpe");
    if (!b) return NULL;
    PyObject *seq = PySequence_Fast(segs, "segs must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t ns = PySequence_Fast_GET_SIZE(seq);
    PyObject *ids = PyList_New(0), *labels = PyList_New(0), *pieces = PyList_New(0);
    /* the pending run: its segments' texts (pieces), their end offsets and labels (borrowed) */
    Py_ssize_t *ends = malloc((ns ? ns : 1) * sizeof(Py_ssize_t));
    PyObject **labs = malloc((ns ? ns : 1) * sizeof(PyObject *));
    Py_ssize_t nrun = 0, run_len = 0;
    PyObject *result = NULL;
    if (!ids || !labels || !pieces || !ends || !labs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t si = 0; si <= ns; si++) {
        PyObject *seg = NULL, *lab = NULL;
        if (si < ns) {
            PyObject *pair = PySequence_Fast_GET_ITEM(seq, si);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                PyErr_SetString(PyExc_TypeError, "a segment is a (text or ids, label) tuple");
                goto done;
            }
            seg = PyTuple_GET_ITEM(pair, 0);
            lab = PyTuple_GET_ITEM(pair, 1);
            if (PyUnicode_Check(seg)) {
                if (PyList_Append(pieces, seg)) goto done;
                run_len += PyUnicode_GET_LENGTH(seg);
                ends[nrun] = run_len;
                labs[nrun] = lab;
                nrun++;
                continue;
            }
        }
        if (run_len > 0) { /* the run so far, tokenized after the context */
            PyObject *empty = PyUnicode_New(0, 0);
            if (!empty) goto done;
            PyObject *text = PyUnicode_Join(empty, pieces);
            Py_DECREF(empty);
            if (!text) goto done;
            PyObject *ctx = PySequence_List(tail); /* the context: the tail and the ids so far */
            if (!ctx || PyList_SetSlice(ctx, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, ids)) {
                Py_XDECREF(ctx);
                Py_DECREF(text);
                goto done;
            }
            PyObject *toks = continuation(b, ctx, text, tail_tokens, decode, fallback);
            Py_DECREF(ctx);
            Py_DECREF(text);
            if (!toks) goto done;
            Py_ssize_t j = 0, last = nrun - 1;
            long long pos = 0;
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(toks); i++) {
                PyObject *t = PyList_GET_ITEM(toks, i);
                while (j < last && pos >= ends[j]) j++;
                long long nc = token_chars(t, chars, chars_of);
                if ((nc == -1 && PyErr_Occurred()) || PyList_Append(ids, t) || PyList_Append(labels, labs[j])) {
                    Py_DECREF(toks);
                    goto done;
                }
                pos += nc;
            }
            Py_DECREF(toks);
            if (PyList_SetSlice(pieces, 0, PyList_GET_SIZE(pieces), NULL)) goto done;
            nrun = 0;
            run_len = 0;
        }
        if (seg != NULL) { /* raw ids (end of turn) */
            int truthy = PyObject_IsTrue(seg);
            if (truthy < 0) goto done;
            if (truthy) {
                PyObject *raw = PySequence_Fast(seg, "a segment is text or a sequence of ids");
                if (!raw) goto done;
                for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(raw); i++)
                    if (PyList_Append(ids, PySequence_Fast_GET_ITEM(raw, i)) || PyList_Append(labels, lab)) {
                        Py_DECREF(raw);
                        goto done;
                    }
                Py_DECREF(raw);
            }
        }
    }
    {
        PyObject *ti = PyList_AsTuple(ids), *tl = PyList_AsTuple(labels);
        if (ti && tl) result = PyTuple_Pack(2, ti, tl);
        Py_XDECREF(ti);
        Py_XDECREF(tl);
    }
done:
    Py_DECREF(seq);
    Py_XDECREF(ids);
    Py_XDECREF(labels);
    Py_XDECREF(pieces);
    free(ends);
    free(labs);
    return result;
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
        long long nc = token_chars(PyList_GET_ITEM(toks, i), chars, chars_of);
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
    {"tokenize", tokenize, METH_VARARGS, "A schema candidate's (ids, labels) after a tail (BoundaryTokenizer.tokenize)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "toolspec_bpe", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_toolspec_bpe(void) { return PyModule_Create(&module); }
