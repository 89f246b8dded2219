/* Suffix drafting's per-step walk (drafters/suffix.py: SuffixDrafter.extend) in C, a batch at once.
 *
 * One job per drafting sequence: the longest suffix of its context (or of its context plus a
 * drafted chain) that occurs earlier in the context, the subtrie of that suffix's continuations
 * built lazily as ``suffix_trie.LazySubtrie`` builds it, and the best-first expansion of
 * ``suffix.grow_from_trie`` into the sequence's draft tree; then the same expansion from the
 * tenant's history trie (a ``SuffixTrie``: a list of dicts, matched in Python). Nodes are added
 * to the ``DraftTree``'s own lists and child index exactly as ``DraftTree.add`` adds them, and the
 * rate keys of the added nodes go into the drafter's ``keys`` dict. Every float is computed as
 * the Python loop computes it (IEEE doubles, no contraction): the trees are the Python ones bit
 * for bit (tests/drafters/test_suffix_kernel.py). The GIL is held throughout: the history trie
 * may be grown by another thread between calls, never during one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NKEYS 18 /* suffix_key: 3 frequency buckets x 3 match-length buckets x seen once or not */

/* ---- a growable array of int64 ---- */
typedef struct {
    int64_t *v;
    int64_t n, cap;
} IVec;

static int ivec_push(IVec *a, int64_t x) {
    if (a->n == a->cap) {
        int64_t cap = a->cap ? a->cap * 2 : 64;
        int64_t *v = realloc(a->v, cap * sizeof(int64_t));
        if (!v) return -1;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

/* ---- the lazy subtrie of a context match (suffix_trie.LazySubtrie) ---- */
typedef struct {
    PyObject *tokens; /* the context's token list (borrowed) */
    int64_t n, depth;
    IVec occ;         /* occurrence end positions, each node's contiguous */
    IVec occ_start, occ_len, at, made; /* per node; made: first child index + 1, or 0 */
    IVec n_kids, kid_tok, count;       /* per node: number of children; its token; its count */
    /* children of a node are the nodes kid_first[node] .. + n_kids[node] - 1 (made consecutively) */
} Sub;

static void sub_free(Sub *s) {
    free(s->occ.v);
    free(s->occ_start.v);
    free(s->occ_len.v);
    free(s->at.v);
    free(s->made.v);
    free(s->n_kids.v);
    free(s->kid_tok.v);
    free(s->count.v);
}

static inline int tok_at(PyObject *list, int64_t i, long *out) {
    long v = PyLong_AsLong(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static int sub_node(Sub *s, int64_t start, int64_t len, int64_t at, long tok, int64_t count) {
    if (ivec_push(&s->occ_start, start) || ivec_push(&s->occ_len, len) || ivec_push(&s->at, at) ||
        ivec_push(&s->made, 0) || ivec_push(&s->n_kids, 0) || ivec_push(&s->kid_tok, tok) ||
        ivec_push(&s->count, count))
        return -1;
    return 0;
}

/* Make ``node``'s children (once): group its occurrences by the token that follows at its depth,
 * children in order of first appearance, each child's occurrences in ascending order. */
static int sub_expand(Sub *s, int64_t node) {
    if (s->made.v[node]) return 0;
    int64_t d = s->at.v[node];
    int64_t first = s->made.n; /* index the first child will get */
    s->made.v[node] = first + 1;
    if (d >= s->depth) return 0;
    int64_t start = s->occ_start.v[node], len = s->occ_len.v[node];
    /* pass 1: the distinct next tokens in order of first appearance, with counts */
    long *toks = malloc((len ? len : 1) * sizeof(long));
    int64_t *cnt = malloc((len ? len : 1) * sizeof(int64_t));
    int64_t *which = malloc((len ? len : 1) * sizeof(int64_t)); /* occurrence -> child slot, -1: none */
    if (!toks || !cnt || !which) goto nomem;
    int64_t k = 0;
    for (int64_t j = 0; j < len; j++) {
        int64_t p = s->occ.v[start + j] + 1 + d;
        which[j] = -1;
        if (p >= s->n) continue;
        long t;
        if (tok_at(s->tokens, p, &t)) goto fail;
        int64_t c = 0;
        while (c < k && toks[c] != t) c++;
        if (c == k) {
            toks[k] = t;
            cnt[k++] = 0;
        }
        cnt[c]++;
        which[j] = c;
    }
    /* pass 2: each child's occurrences, contiguous */
    int64_t base = s->occ.n;
    int64_t off = base;
    for (int64_t c = 0; c < k; c++) {
        if (sub_node(s, off, 0, d + 1, toks[c], cnt[c])) goto nomem;
        off += cnt[c];
    }
    for (int64_t j = 0; j < off - base; j++)
        if (ivec_push(&s->occ, 0)) goto nomem;
    for (int64_t j = 0; j < len; j++) {
        int64_t c = which[j];
        if (c < 0) continue;
        int64_t child = first + c;
        s->occ.v[s->occ_start.v[child] + s->occ_len.v[child]++] = s->occ.v[start + j];
    }
    s->n_kids.v[node] = k;
    free(toks);
    free(cnt);
    free(which);
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    free(toks);
    free(cnt);
    free(which);
    return -1;
}

/* ContextIndex._match: the longest suffix (<= cap tokens) of ``pattern`` that occurs in
 * ``tokens`` followed by a token; its subtrie's root (node 0) set up in ``s``. Returns the match
 * length (0: none) or -1 on error. */
static int64_t context_match(Sub *s, PyObject *tokens, PyObject *where, PyObject *pattern, int64_t cap,
                             int64_t trie_depth) {
    Py_ssize_t plen = PyList_GET_SIZE(pattern);
    if (cap < 1 || plen == 0) return 0;
    int64_t n = PyList_GET_SIZE(tokens);
    PyObject *occ = PyDict_GetItemWithError(where, PyList_GET_ITEM(pattern, plen - 1));
    if (!occ) return PyErr_Occurred() ? -1 : 0;
    if (!PyList_Check(occ)) {
        PyErr_SetString(PyExc_TypeError, "positions must be a list");
        return -1;
    }
    Py_ssize_t no = PyList_GET_SIZE(occ);
    int64_t *ends = malloc((no ? no : 1) * sizeof(int64_t)), *ms = malloc((no ? no : 1) * sizeof(int64_t));
    if (!ends || !ms) {
        free(ends);
        free(ms);
        PyErr_NoMemory();
        return -1;
    }
    int64_t ne = 0, best = 0, last = plen - 1;
    for (Py_ssize_t i = 0; i < no; i++) {
        long e = PyLong_AsLong(PyList_GET_ITEM(occ, i));
        if (e == -1 && PyErr_Occurred()) goto fail;
        if (e >= n - 1) break;
        int64_t m = 1;
        while (m < cap && m <= e) {
            long a, b;
            if (tok_at(tokens, e - m, &a) || tok_at(pattern, last - m, &b)) goto fail;
            if (a != b) break;
            m++;
        }
        ends[ne] = e;
        ms[ne++] = m;
        if (m > best) best = m;
    }
    if (best) {
        s->tokens = tokens;
        s->n = n;
        s->depth = trie_depth - best;
        if (sub_node(s, 0, 0, 0, -1, 0)) goto nomem;
        for (int64_t i = 0; i < ne; i++)
            if (ms[i] >= best) {
                if (ivec_push(&s->occ, ends[i])) goto nomem;
                s->occ_len.v[0]++;
            }
    }
    free(ends);
    free(ms);
    return best;
nomem:
    PyErr_NoMemory();
fail:
    free(ends);
    free(ms);
    return -1;
}

/* ---- the draft tree, added to as DraftTree.add does ---- */
typedef struct {
    PyObject *tokens, *parents, *conf, *labels, *kids; /* borrowed from the DraftTree */
} TreeRef;

static int tree_ref(PyObject *tree, TreeRef *t) {
    PyObject *objs[5];
    const char *names[5] = {"tokens", "parents", "conf", "labels", "_kids"};
    for (int i = 0; i < 5; i++) {
        objs[i] = PyObject_GetAttrString(tree, names[i]);
        if (!objs[i]) {
            for (int j = 0; j < i; j++) Py_DECREF(objs[j]);
            return -1;
        }
        Py_DECREF(objs[i]); /* the tree holds them for the call */
    }
    t->tokens = objs[0];
    t->parents = objs[1];
    t->conf = objs[2];
    t->labels = objs[3];
    t->kids = objs[4];
    if (!PyList_Check(t->tokens) || !PyList_Check(t->parents) || !PyList_Check(t->conf) ||
        !PyList_Check(t->labels) || !PyDict_Check(t->kids)) {
        PyErr_SetString(PyExc_TypeError, "a DraftTree of lists with its child index");
        return -1;
    }
    if (PyDict_GET_SIZE(t->kids) != PyList_GET_SIZE(t->tokens)) {
        PyErr_SetString(PyExc_ValueError, "the tree's child index is not in step (call tree.child first)");
        return -1;
    }
    return 0;
}

/* DraftTree.add(parent, tok, conf, label): the node index, or -1 on error. */
static int64_t tree_add(TreeRef *t, long parent, long tok, double conf, PyObject *label) {
    PyObject *key = Py_BuildValue("(ll)", parent, tok);
    if (!key) return -1;
    PyObject *hit = PyDict_GetItemWithError(t->kids, key);
    if (hit) {
        Py_DECREF(key);
        Py_ssize_t i = PyLong_AsSsize_t(hit);
        if (i == -1 && PyErr_Occurred()) return -1;
        double old = PyFloat_AsDouble(PyList_GET_ITEM(t->conf, i));
        if (old == -1.0 && PyErr_Occurred()) return -1;
        if (conf > old) {
            PyObject *c = PyFloat_FromDouble(conf);
            if (!c) return -1;
            if (PyList_SetItem(t->conf, i, c)) return -1; /* steals c */
            Py_INCREF(label);
            if (PyList_SetItem(t->labels, i, label)) return -1;
        }
        return i;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    Py_ssize_t i = PyList_GET_SIZE(t->tokens);
    PyObject *pt = PyLong_FromLong(tok), *pp = PyLong_FromLong(parent), *pc = PyFloat_FromDouble(conf),
             *pi = PyLong_FromSsize_t(i);
    int bad = !pt || !pp || !pc || !pi || PyList_Append(t->tokens, pt) || PyList_Append(t->parents, pp) ||
              PyList_Append(t->conf, pc) || PyList_Append(t->labels, label) || PyDict_SetItem(t->kids, key, pi);
    Py_XDECREF(pt);
    Py_XDECREF(pp);
    Py_XDECREF(pc);
    Py_XDECREF(pi);
    Py_DECREF(key);
    return bad ? -1 : i;
}

/* ---- the best-first expansion (suffix.grow_from_trie) ---- */
typedef struct {
    double neg; /* -path probability */
    int64_t tie, tnode, parent, depth;
    PyObject *path; /* owned: the token path (a tuple) */
} Entry;

typedef struct {
    Entry *e;
    int64_t n, cap;
} Heap;

static inline int entry_less(const Entry *a, const Entry *b) {
    return a->neg < b->neg || (a->neg == b->neg && a->tie < b->tie);
}

static int heap_push(Heap *h, Entry x) {
    if (h->n == h->cap) {
        int64_t cap = h->cap ? h->cap * 2 : 64;
        Entry *e = realloc(h->e, cap * sizeof(Entry));
        if (!e) return -1;
        h->e = e;
        h->cap = cap;
    }
    int64_t i = h->n++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!entry_less(&x, &h->e[p])) break;
        h->e[i] = h->e[p];
        i = p;
    }
    h->e[i] = x;
    return 0;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->e[0], x = h->e[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        const Entry *best = &x;
        if (l < h->n && entry_less(&h->e[l], best)) {
            m = l;
            best = &h->e[l];
        }
        if (r < h->n && entry_less(&h->e[r], best)) m = r;
        if (m == i) break;
        h->e[i] = h->e[m];
        i = m;
    }
    if (h->n) h->e[i] = x;
    return top;
}

static void heap_free(Heap *h) {
    for (int64_t i = 0; i < h->n; i++) Py_DECREF(h->e[i].path);
    free(h->e);
}

/* suffix_key's index: frequency bucket x match-length bucket x seen once (the order of KEYS in suffix.py) */
static inline int key_index(double freq, int64_t match_len, int64_t seen) {
    int fb = freq >= 0.8 ? 0 : freq >= 0.4 ? 1 : 2;
    int ml = match_len >= 6 ? 0 : match_len >= 3 ? 1 : 2;
    return (fb * 3 + ml) * 2 + (seen == 1);
}

typedef struct {
    Sub *sub;         /* a context subtrie, or */
    PyObject *kids;   /* a SuffixTrie's kids (list of dicts) */
    PyObject *counts; /* ... and its counts */
} Source;

typedef struct {
    TreeRef tree;
    PyObject *keys, *key_names, *rate, *label;
    double rated[NKEYS];
    int have[NKEYS];
    int64_t max_nodes, max_depth;
    double min_prob;
} Grow;

/* The children of ``tnode``: (token, child node, count) into the arrays; their number or -1. */
static int64_t children(Source *src, int64_t tnode, long **tok, int64_t **node, int64_t **cnt, int64_t *cap) {
    int64_t k;
    if (src->sub) {
        if (sub_expand(src->sub, tnode)) return -1;
        k = src->sub->n_kids.v[tnode];
    } else {
        PyObject *edges = PyList_GetItem(src->kids, tnode);
        if (!edges) return -1;
        if (!PyDict_Check(edges)) {
            PyErr_SetString(PyExc_TypeError, "trie nodes must be dicts");
            return -1;
        }
        k = PyDict_GET_SIZE(edges);
    }
    if (k > *cap) {
        *cap = k;
        long *t = realloc(*tok, k * sizeof(long));
        if (t) *tok = t;
        int64_t *nd = realloc(*node, k * sizeof(int64_t));
        if (nd) *node = nd;
        int64_t *c = realloc(*cnt, k * sizeof(int64_t));
        if (c) *cnt = c;
        if (!t || !nd || !c) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (src->sub) {
        int64_t first = src->sub->made.v[tnode] - 1;
        for (int64_t i = 0; i < k; i++) {
            (*tok)[i] = src->sub->kid_tok.v[first + i];
            (*node)[i] = first + i;
            (*cnt)[i] = src->sub->count.v[first + i];
        }
        return k;
    }
    PyObject *edges = PyList_GET_ITEM(src->kids, tnode), *kt, *kv;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(edges, &pos, &kt, &kv)) {
        long t = PyLong_AsLong(kt);
        Py_ssize_t c = PyLong_AsSsize_t(kv);
        if ((t == -1 || c == -1) && PyErr_Occurred()) return -1;
        PyObject *pc = PyList_GetItem(src->counts, c);
        if (!pc) return -1;
        long long cc = PyLong_AsLongLong(pc);
        if (cc == -1 && PyErr_Occurred()) return -1;
        (*tok)[i] = t;
        (*node)[i] = c;
        (*cnt)[i++] = cc;
    }
    return k;
}

static int rate_of(Grow *g, int k, double *out) {
    if (!g->have[k]) {
        PyObject *r = PyObject_CallFunctionObjArgs(g->rate, PyTuple_GET_ITEM(g->key_names, k), NULL);
        if (!r) return -1;
        double v = PyFloat_AsDouble(r);
        Py_DECREF(r);
        if (v == -1.0 && PyErr_Occurred()) return -1;
        g->rated[k] = v;
        g->have[k] = 1;
    }
    *out = g->rated[k];
    return 0;
}

static PyObject *tuple_plus(PyObject *path, long tok) {
    Py_ssize_t n = PyTuple_GET_SIZE(path);
    PyObject *out = PyTuple_New(n + 1);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyTuple_GET_ITEM(path, i);
        Py_INCREF(x);
        PyTuple_SET_ITEM(out, i, x);
    }
    PyObject *t = PyLong_FromLong(tok);
    if (!t) {
        Py_DECREF(out);
        return NULL;
    }
    PyTuple_SET_ITEM(out, n, t);
    return out;
}

/* grow_from_trie(tree, keys, source, node, match_len, ...): 0, or -1 on error. */
static int grow(Grow *g, Source *src, int64_t node, int64_t match_len, int64_t parent, PyObject *prefix,
                double prob) {
    for (int i = 0; i < NKEYS; i++) g->have[i] = 0; /* the rates of one expansion */
    Heap h = {0};
    long *ktok = NULL;
    int64_t *knode = NULL, *kcnt = NULL, kcap = 0, tie = 0, added = 0;
    Py_INCREF(prefix);
    if (heap_push(&h, (Entry){-prob, tie++, node, parent, 0, prefix})) {
        Py_DECREF(prefix);
        goto nomem;
    }
    while (h.n && added < g->max_nodes) {
        Entry cur = heap_pop(&h);
        if (cur.depth >= g->max_depth) {
            Py_DECREF(cur.path);
            continue;
        }
        int64_t k = children(src, cur.tnode, &ktok, &knode, &kcnt, &kcap);
        if (k < 0) {
            Py_DECREF(cur.path);
            goto fail;
        }
        int64_t total = 0;
        for (int64_t i = 0; i < k; i++) total += kcnt[i];
        for (int64_t i = 0; i < k; i++) {
            double freq = (double)kcnt[i] / (double)total;
            int ki = key_index(freq, match_len + cur.depth, total);
            double conf;
            if (rate_of(g, ki, &conf)) {
                Py_DECREF(cur.path);
                goto fail;
            }
            double score = -cur.neg * conf;
            if (score < g->min_prob || added >= g->max_nodes) continue;
            int64_t idx = tree_add(&g->tree, (long)cur.parent, ktok[i], conf, g->label);
            if (idx < 0) {
                Py_DECREF(cur.path);
                goto fail;
            }
            added++;
            PyObject *sub = tuple_plus(cur.path, ktok[i]);
            if (!sub) {
                Py_DECREF(cur.path);
                goto fail;
            }
            int has = PyDict_Contains(g->keys, sub);
            double now = has == 1 ? PyFloat_AsDouble(PyList_GET_ITEM(g->tree.conf, idx)) : 0.0;
            if (has < 0 || (has == 1 && now == -1.0 && PyErr_Occurred()) ||
                ((has == 0 || conf >= now) && PyDict_SetItem(g->keys, sub, PyTuple_GET_ITEM(g->key_names, ki)))) {
                Py_DECREF(sub);
                Py_DECREF(cur.path);
                goto fail;
            }
            if (heap_push(&h, (Entry){-score, tie++, knode[i], idx, cur.depth + 1, sub})) {
                Py_DECREF(sub);
                Py_DECREF(cur.path);
                goto nomem;
            }
        }
        Py_DECREF(cur.path);
    }
    heap_free(&h);
    free(ktok);
    free(knode);
    free(kcnt);
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    heap_free(&h);
    free(ktok);
    free(knode);
    free(kcnt);
    return -1;
}

/* walk(jobs, key_names, label, min_prob): each job
 *   (tree, keys, rate, parent, prefix, prob, max_nodes, max_depth,
 *    context_tokens, context_where, pattern, cap, trie_depth,
 *    history_kids, history_counts, history_node, history_match)
 * grows the context match (pattern None: no context) then the history match (history_node < 0:
 * none) into tree. Returns the list of context match lengths (0: no match). */
static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *jobs, *key_names, *label;
    double min_prob;
    if (!PyArg_ParseTuple(args, "O!O!Od", &PyList_Type, &jobs, &PyTuple_Type, &key_names, &label, &min_prob))
        return NULL;
    if (PyTuple_GET_SIZE(key_names) != NKEYS) {
        PyErr_SetString(PyExc_ValueError, "18 rate keys");
        return NULL;
    }
    Py_ssize_t nj = PyList_GET_SIZE(jobs);
    PyObject *out = PyList_New(nj);
    if (!out) return NULL;
    for (Py_ssize_t j = 0; j < nj; j++) {
        PyObject *tree, *keys, *rate, *prefix, *ctoks, *cwhere, *pattern, *hkids, *hcounts;
        long parent;
        double prob;
        long long max_nodes, max_depth, cap, trie_depth, hnode, hmatch;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(jobs, j), "OO!OlO!dLLOOOLLOOLL", &tree, &PyDict_Type, &keys, &rate,
                              &parent, &PyTuple_Type, &prefix, &prob, &max_nodes, &max_depth, &ctoks, &cwhere,
                              &pattern, &cap, &trie_depth, &hkids, &hcounts, &hnode, &hmatch))
            goto fail;
        Grow g = {.keys = keys, .key_names = key_names, .rate = rate, .label = label, .max_nodes = max_nodes,
                  .max_depth = max_depth, .min_prob = min_prob};
        if (tree_ref(tree, &g.tree)) goto fail;
        int64_t m = 0;
        if (pattern != Py_None) {
            if (!PyList_Check(ctoks) || !PyDict_Check(cwhere) || !PyList_Check(pattern)) {
                PyErr_SetString(PyExc_TypeError, "context tokens, positions and pattern: list, dict, list");
                goto fail;
            }
            Sub s = {0};
            m = context_match(&s, ctoks, cwhere, pattern, cap, trie_depth);
            int bad = m < 0;
            if (m > 0) {
                Source src = {&s, NULL, NULL};
                bad = grow(&g, &src, 0, m, parent, prefix, prob) != 0;
            }
            sub_free(&s);
            if (bad) goto fail;
        }
        if (hnode >= 0) {
            if (!PyList_Check(hkids) || !PyList_Check(hcounts)) {
                PyErr_SetString(PyExc_TypeError, "history kids and counts must be lists");
                goto fail;
            }
            Source src = {NULL, hkids, hcounts};
            if (grow(&g, &src, hnode, hmatch, parent, prefix, prob)) goto fail;
        }
        PyObject *pm = PyLong_FromLongLong(m);
        if (!pm) goto fail;
        PyList_SET_ITEM(out, j, pm);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "Suffix drafting's match and best-first expansion for a batch of sequences."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "toolspec_suffix_walk", NULL, -1, methods};

PyMODINIT_FUNC PyInit_toolspec_suffix_walk(void) { return PyModule_Create(&module); }
