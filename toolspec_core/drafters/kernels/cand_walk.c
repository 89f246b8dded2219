/* The schema candidates' expansion walk (drafters/toolcall/candidates.py: _Walk, walk) in C.
 *
 * The candidate builder emits the expansion as a graph of nodes, each a flat tuple of instructions
 * of WIDTH fields (kind, prob, child, op, slot, segs, nonempty); a node not yet built is None in the node list and a
 * Python callable builds it (``Graph.build``) the first time the walk reaches it. This walks the
 * graph from a root under the levels (``levels`` at the root; each child at the level its
 * instruction's ``op`` says) and the two floors -- the bounded expansion's (the ``keep``-th
 * largest leaf probability so far, a min-heap) and the budget's (``min_prob``) -- and returns the
 * non-empty candidates, most probable first (stable), at most ``max_cands``, as
 * (prob, list of segments). A candidate is a chain of cells (its segments are its cells'
 * ``segs`` tuples in chain order), so a branch's prefix is shared, not copied. Every float is
 * computed in the Python walk's order (IEEE doubles, no contraction): the result is the Python
 * one bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

enum { SEQ, SEQ_LEAF, SHARED, SEQ_SHARED, LEAF, CAND, MUL, DIV, INLINE, GUARD };
enum { SAME, DOWN, DOWN_IF, ZERO }; /* a child's level: the parent's, one less, one less if above 0, 0 */
#define SLACK 1e-9
#define MAX_SLOTS 16 /* SHARED slots live at once in one node's instructions */
#define WIDTH 7      /* fields an instruction */

typedef struct {
    double *prob;
    PyObject **segs; /* borrowed from the graph's instruction tuples; NULL: none (a rescaled cell) */
    Py_ssize_t *next; /* the cell that follows (-1: the end) */
    char *ne;         /* any segment of the chain from here writes something */
    Py_ssize_t n, cap;
} Cells;

typedef struct {
    Py_ssize_t *v;
    Py_ssize_t n, cap;
} Vec;

typedef struct {
    PyObject *nodes, *build;
    Py_ssize_t keep;
    double min_prob, mult;
    long lv; /* levels left below the node being walked */
    double *heap;
    Py_ssize_t hn;
    long cuts;
    Cells c;
    Vec out;    /* the candidates (cell ids) of the expansions in progress, innermost last */
    Vec shared; /* the SHARED slots' candidates */
} W;

static int vec_push(Vec *v, Py_ssize_t x) {
    if (v->n == v->cap) {
        Py_ssize_t cap = v->cap ? v->cap * 2 : 256;
        Py_ssize_t *p = realloc(v->v, cap * sizeof(Py_ssize_t));
        if (!p) return -1;
        v->v = p;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return 0;
}

/* a new cell; its id, or -1 (no memory) */
static Py_ssize_t cell(W *w, double prob, PyObject *segs, Py_ssize_t next, char ne) {
    Cells *c = &w->c;
    if (c->n == c->cap) {
        Py_ssize_t cap = c->cap ? c->cap * 2 : 256;
        double *p = realloc(c->prob, cap * sizeof(double));
        if (!p) return -1;
        c->prob = p;
        PyObject **s = realloc(c->segs, cap * sizeof(PyObject *));
        if (!s) return -1;
        c->segs = s;
        Py_ssize_t *nx = realloc(c->next, cap * sizeof(Py_ssize_t));
        if (!nx) return -1;
        c->next = nx;
        char *e = realloc(c->ne, cap);
        if (!e) return -1;
        c->ne = e;
        c->cap = cap;
    }
    c->prob[c->n] = prob;
    c->segs[c->n] = segs;
    c->next[c->n] = next;
    c->ne[c->n] = ne;
    return c->n++;
}

static int below(W *w, double prob) {
    if (!w->keep) return 0;
    double floor = w->hn >= w->keep ? w->heap[0] : 0.0;
    if (w->mult * prob * (1.0 + SLACK) < floor) {
        w->cuts++;
        return 1;
    }
    return 0;
}

static void heap_push(W *w, double p) {
    double *h = w->heap;
    if (w->hn < w->keep) { /* sift up */
        Py_ssize_t i = w->hn++;
        while (i > 0) {
            Py_ssize_t up = (i - 1) / 2;
            if (h[up] <= p) break;
            h[i] = h[up];
            i = up;
        }
        h[i] = p;
        return;
    }
    if (!(h[0] < p)) return; /* heappushpop: the new value is the smallest */
    Py_ssize_t i = 0, n = w->hn;
    for (;;) { /* sift down from the root */
        Py_ssize_t l = 2 * i + 1, m;
        if (l >= n) break;
        m = (l + 1 < n && h[l + 1] < h[l]) ? l + 1 : l;
        if (h[m] >= p) break;
        h[i] = h[m];
        i = m;
    }
    h[i] = p;
}

/* a leaf: one of the bounded floor's probabilities; appended to out */
static int leaf(W *w, PyObject *segs, char ne, double prob) {
    if (w->keep && ne) {
        double p = w->mult * prob;
        if (p > 0) heap_push(w, p);
    }
    Py_ssize_t id = cell(w, prob, segs, -1, ne);
    return id < 0 ? -1 : vec_push(&w->out, id);
}

static PyObject *node(W *w, Py_ssize_t i) { /* borrowed: the node list holds it */
    if (i < 0 || i >= PyList_GET_SIZE(w->nodes)) {
        PyErr_SetString(PyExc_IndexError, "cand_walk: node id out of range");
        return NULL;
    }
    PyObject *n = PyList_GET_ITEM(w->nodes, i);
    if (n == Py_None) {
        PyObject *r = PyObject_CallFunction(w->build, "n", i);
        if (!r) return NULL;
        Py_DECREF(r);
        n = PyList_GET_ITEM(w->nodes, i);
        if (n == Py_None) {
            PyErr_SetString(PyExc_RuntimeError, "cand_walk: build left the node unbuilt");
            return NULL;
        }
    }
    return n;
}

static int run(W *w, PyObject *instrs);

/* ``child`` expanded with factor prob above it: its candidates appended to out from the returned
 * start; *cut when all of it was below the floor (-1: error) */
static Py_ssize_t under(W *w, double prob, Py_ssize_t child, long op, int *cut) {
    Py_ssize_t s = w->out.n;
    *cut = 0;
    if (below(w, prob)) {
        *cut = 1;
        return s;
    }
    if (w->mult * prob < w->min_prob) return s;
    double outer = w->mult;
    long cuts = w->cuts, lv = w->lv;
    w->mult = outer * prob;
    w->lv = op == SAME ? lv : op == ZERO ? 0 : lv - 1;
    PyObject *ins = node(w, child);
    if (!ins || run(w, ins) < 0) return -1;
    w->mult = outer;
    w->lv = lv;
    if (w->out.n == s && w->cuts != cuts) *cut = 1;
    return s;
}

/* segs then each of the candidates out[s:] in place, or segs alone (a leaf) where there are none */
static int then(W *w, Py_ssize_t s, int cut, PyObject *segs, char ne, double prob) {
    Py_ssize_t e = w->out.n;
    if (e == s) return cut ? 0 : leaf(w, segs, ne, prob);
    for (Py_ssize_t i = s; i < e; i++) {
        Py_ssize_t t = w->out.v[i];
        Py_ssize_t id = cell(w, prob * w->c.prob[t], segs, t, (char)(ne | w->c.ne[t]));
        if (id < 0) return -1;
        w->out.v[i] = id;
    }
    return 0;
}

static int run(W *w, PyObject *instrs) {
    if (!PyTuple_Check(instrs) || PyTuple_GET_SIZE(instrs) % WIDTH) {
        PyErr_SetString(PyExc_TypeError, "cand_walk: a node is a flat tuple of instructions");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(instrs) / WIDTH, shared0 = w->shared.n;
    PyObject **items = ((PyTupleObject *)instrs)->ob_item;
    long slot_id[MAX_SLOTS];
    Py_ssize_t slot_start[MAX_SLOTS], slot_n[MAX_SLOTS];
    int slot_cut[MAX_SLOTS], nslots = 0, rc = -1;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject **ins = items + k * WIDTH;
        long kind = PyLong_AsLong(ins[0]);
        double prob = PyFloat_AsDouble(ins[1]);
        Py_ssize_t child = PyLong_AsSsize_t(ins[2]);
        long op = PyLong_AsLong(ins[3]);
        long slot = PyLong_AsLong(ins[4]);
        PyObject *segs = ins[5];
        char ne = (char)(ins[6] == Py_True);
        if (PyErr_Occurred()) goto done;
        if (!PyTuple_Check(segs)) {
            PyErr_SetString(PyExc_TypeError, "cand_walk: an instruction's segments are a tuple");
            goto done;
        }
        int cut, spent = op == DOWN_IF && w->lv <= 0; /* the branch ends here: no levels left below */
        Py_ssize_t s;
        if (kind == GUARD) {
            if (w->lv < 0) break;
            continue;
        }
        switch (kind) {
        case SEQ:
            if (spent) {
                if (!below(w, prob) && leaf(w, segs, ne, prob) < 0) goto done;
            } else if ((s = under(w, prob, child, op, &cut)) < 0 || then(w, s, cut, segs, ne, prob) < 0)
                goto done;
            break;
        case SEQ_LEAF:
            if (!below(w, prob) && leaf(w, segs, ne, prob) < 0) goto done;
            break;
        case SHARED:
            if (spent) {
                s = w->out.n;
                cut = 0;
            } else if ((s = under(w, prob, child, op, &cut)) < 0)
                goto done;
            if (nslots == MAX_SLOTS) {
                PyErr_SetString(PyExc_RuntimeError, "cand_walk: too many shared slots in one node");
                goto done;
            }
            slot_id[nslots] = slot;
            slot_start[nslots] = w->shared.n;
            slot_n[nslots] = w->out.n - s;
            slot_cut[nslots++] = cut;
            for (Py_ssize_t i = s; i < w->out.n; i++)
                if (vec_push(&w->shared, w->out.v[i]) < 0) goto nomem;
            w->out.n = s;
            break;
        case SEQ_SHARED: {
            int j = nslots - 1;
            while (j >= 0 && slot_id[j] != slot) j--;
            if (j < 0) {
                PyErr_SetString(PyExc_RuntimeError, "cand_walk: a shared slot used before it is filled");
                goto done;
            }
            if (below(w, prob)) break;
            s = w->out.n;
            for (Py_ssize_t i = 0; i < slot_n[j]; i++)
                if (vec_push(&w->out, w->shared.v[slot_start[j] + i]) < 0) goto nomem;
            if (then(w, s, slot_cut[j], segs, ne, prob) < 0) goto done;
            break;
        }
        case LEAF:
            if (leaf(w, segs, ne, prob) < 0) goto done;
            break;
        case CAND: {
            Py_ssize_t id = cell(w, prob, segs, -1, ne);
            if (id < 0 || vec_push(&w->out, id) < 0) goto nomem;
            break;
        }
        case MUL:
        case DIV:
            if ((s = under(w, kind == MUL ? prob : 1.0 / prob, child, op, &cut)) < 0) goto done;
            for (Py_ssize_t i = s; i < w->out.n; i++) {
                Py_ssize_t t = w->out.v[i];
                double p = kind == MUL ? w->c.prob[t] * prob : w->c.prob[t] / prob;
                Py_ssize_t id = cell(w, p, NULL, t, w->c.ne[t]);
                if (id < 0) goto nomem;
                w->out.v[i] = id;
            }
            break;
        case INLINE: {
            PyObject *sub = node(w, child);
            if (!sub || run(w, sub) < 0) goto done;
            break;
        }
        default:
            PyErr_SetString(PyExc_ValueError, "cand_walk: unknown instruction kind");
            goto done;
        }
    }
    rc = 0;
    goto done;
nomem:
    PyErr_NoMemory();
done:
    w->shared.n = shared0;
    return rc;
}

static const double *sort_prob;

static int by_prob(const void *a, const void *b) { /* most probable first; ties in order */
    Py_ssize_t i = *(const Py_ssize_t *)a, j = *(const Py_ssize_t *)b;
    double p = sort_prob[i], q = sort_prob[j];
    if (p > q) return -1;
    if (p < q) return 1;
    return i < j ? -1 : i > j;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *root, *nodes, *build;
    Py_ssize_t keep, max_cands;
    double min_prob;
    long levels;
    if (!PyArg_ParseTuple(args, "OO!Ondnl", &root, &PyList_Type, &nodes, &build, &keep, &min_prob, &max_cands,
                          &levels))
        return NULL;
    W w;
    memset(&w, 0, sizeof w);
    w.nodes = nodes;
    w.build = build;
    w.keep = keep > 0 ? keep : 0;
    w.min_prob = min_prob;
    w.mult = 1.0;
    w.lv = levels;
    PyObject *result = NULL;
    Py_ssize_t *order = NULL, *pos = NULL;
    double *probs = NULL;
    if (w.keep && !(w.heap = malloc(w.keep * sizeof(double)))) goto nomem;
    if (run(&w, root) < 0) goto fail;
    /* the non-empty candidates with prob > 0, most probable first, ties in order */
    Py_ssize_t n = 0;
    order = malloc((w.out.n + 1) * sizeof(Py_ssize_t));
    pos = malloc((w.out.n + 1) * sizeof(Py_ssize_t));
    probs = malloc((w.out.n + 1) * sizeof(double));
    if (!order || !pos || !probs) goto nomem;
    for (Py_ssize_t i = 0; i < w.out.n; i++) {
        Py_ssize_t t = w.out.v[i];
        if (w.c.prob[t] > 0 && w.c.ne[t]) {
            pos[n] = t;
            probs[n] = w.c.prob[t];
            order[n] = n;
            n++;
        }
    }
    sort_prob = probs;
    qsort(order, n, sizeof(Py_ssize_t), by_prob);
    if (n > max_cands) n = max_cands > 0 ? max_cands : 0;
    result = PyList_New(n);
    if (!result) goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t t = pos[order[k]];
        PyObject *segs = PyList_New(0);
        if (!segs) goto fail;
        for (Py_ssize_t c = t; c >= 0; c = w.c.next[c]) {
            PyObject *part = w.c.segs[c];
            if (part == NULL) continue;
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(part); j++)
                if (PyList_Append(segs, PyTuple_GET_ITEM(part, j)) < 0) {
                    Py_DECREF(segs);
                    goto fail;
                }
        }
        PyObject *pair = Py_BuildValue("(dN)", w.c.prob[t], segs);
        if (!pair) goto fail;
        PyList_SET_ITEM(result, k, pair);
    }
    goto out;
nomem:
    PyErr_NoMemory();
fail:
    Py_CLEAR(result);
out:
    free(order);
    free(pos);
    free(probs);
    free(w.heap);
    free(w.c.prob);
    free(w.c.segs);
    free(w.c.next);
    free(w.c.ne);
    free(w.out.v);
    free(w.shared.v);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS,
     "walk(root, nodes, build, keep, min_prob, max_cands, levels): the candidates of root, most probable first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "toolspec_cand_walk", NULL, -1, methods};

PyMODINIT_FUNC PyInit_toolspec_cand_walk(void) { return PyModule_Create(&module); }
