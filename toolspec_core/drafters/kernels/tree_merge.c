/* The schema tree's merge loop (drafters/toolcall/drafter.py: candidates_to_tree) in C.
 *
 * Candidates, most probable first, are tokenized by a Python callable (the boundary tokenizer
 * and its cache stay in Python) and merged into one trie: node mass = summed probability of the
 * candidates through it, a node's rate from a Python callable per (label, parent label), the
 * stop once ``max_nodes`` nodes are above the mass the remaining candidates could still add,
 * and each node's confidence. Every float is computed in the order the Python loop computes it
 * (IEEE doubles, no contraction), so the tree is the Python one bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t n, cap;
    long *tok;
    long *par;
    double *mass, *path_rate, *node_rate;
    PyObject **label; /* borrowed from the candidates' label tuples, owned by the label list */
    /* (parent, token) -> node + 1, open addressing */
    uint64_t *keys;
    int64_t *vals;
    int64_t hcap;
} Tree;

static int grow_nodes(Tree *t) {
    int64_t cap = t->cap ? t->cap * 2 : 256;
    long *tok = realloc(t->tok, cap * sizeof(long));
    if (!tok) return -1;
    t->tok = tok;
    long *par = realloc(t->par, cap * sizeof(long));
    if (!par) return -1;
    t->par = par;
    double *m = realloc(t->mass, cap * sizeof(double));
    if (!m) return -1;
    t->mass = m;
    double *pr = realloc(t->path_rate, cap * sizeof(double));
    if (!pr) return -1;
    t->path_rate = pr;
    double *nr = realloc(t->node_rate, cap * sizeof(double));
    if (!nr) return -1;
    t->node_rate = nr;
    PyObject **lab = realloc(t->label, cap * sizeof(PyObject *));
    if (!lab) return -1;
    t->label = lab;
    t->cap = cap;
    return 0;
}

static inline uint64_t hkey(long parent, long token) {
    return ((uint64_t)(uint32_t)(parent + 1) << 32) | (uint64_t)(uint32_t)token;
}

static inline uint64_t hmix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

static int rehash(Tree *t, int64_t hcap) {
    uint64_t *keys = calloc(hcap, sizeof(uint64_t));
    int64_t *vals = calloc(hcap, sizeof(int64_t));
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    for (int64_t i = 0; i < t->n; i++) {
        uint64_t k = hkey(t->par[i], t->tok[i]);
        uint64_t h = hmix(k) & (hcap - 1);
        while (vals[h]) h = (h + 1) & (hcap - 1);
        keys[h] = k;
        vals[h] = i + 1;
    }
    free(t->keys);
    free(t->vals);
    t->keys = keys;
    t->vals = vals;
    t->hcap = hcap;
    return 0;
}

static int64_t find(const Tree *t, long parent, long token) {
    uint64_t k = hkey(parent, token);
    uint64_t h = hmix(k) & (t->hcap - 1);
    while (t->vals[h]) {
        if (t->keys[h] == k) return t->vals[h] - 1;
        h = (h + 1) & (t->hcap - 1);
    }
    return -1;
}

static int insert(Tree *t, long parent, long token, int64_t node) {
    if ((node + 1) * 2 > t->hcap && rehash(t, t->hcap ? t->hcap * 2 : 1024) < 0) return -1;
    uint64_t k = hkey(parent, token);
    uint64_t h = hmix(k) & (t->hcap - 1);
    while (t->vals[h]) h = (h + 1) & (t->hcap - 1);
    t->keys[h] = k;
    t->vals[h] = node + 1;
    return 0;
}

static void tree_free(Tree *t) {
    free(t->tok);
    free(t->par);
    free(t->mass);
    free(t->path_rate);
    free(t->node_rate);
    free(t->label);
    free(t->keys);
    free(t->vals);
}

/* rates per (label, parent label) object pair: the labels are a handful of interned strings */
typedef struct {
    PyObject *lab, *plab;
    double r;
} RateEntry;

static int kept_above(const Tree *t, int64_t n, double bound) {
    int64_t above = 0;
    for (int64_t i = 0; i < t->n; i++) {
        if (t->mass[i] * t->path_rate[i] > bound) {
            if (++above >= n) return 1;
        }
    }
    return 0;
}

/* merge(tail, segs, probs, candidate, rate, left, max_tokens, max_nodes)
 *   -> (tokens, parents, conf, labels, kids) */
static PyObject *merge(PyObject *self, PyObject *args) {
    PyObject *tail, *segs, *probs, *candidate, *rate;
    double left;
    Py_ssize_t max_tokens, max_nodes;
    if (!PyArg_ParseTuple(args, "OO!O!OOdnn", &tail, &PyList_Type, &segs, &PyList_Type, &probs, &candidate,
                          &rate, &left, &max_tokens, &max_nodes))
        return NULL;
    Py_ssize_t nc = PyList_GET_SIZE(segs);
    if (PyList_GET_SIZE(probs) != nc) {
        PyErr_SetString(PyExc_ValueError, "segs and probs differ in length");
        return NULL;
    }
    Tree t;
    memset(&t, 0, sizeof(t));
    RateEntry rates[64];
    int nrates = 0;
    PyObject *labels = PyList_New(0); /* owns every node's label */
    PyObject *result = NULL;
    int64_t *chain = NULL;
    Py_ssize_t chain_cap = 0;
    if (!labels) return NULL;
    if (rehash(&t, 1024) < 0) goto nomem;
    double scale = left > 1.0 ? left : 1.0;
    double top = 0.0;
    for (Py_ssize_t k = 0; k < nc; k++) {
        double prob = PyFloat_AsDouble(PyList_GET_ITEM(probs, k));
        if (prob == -1.0 && PyErr_Occurred()) goto fail;
        double bound = left * scale;
        if (max_nodes >= 0 && t.n >= max_nodes && bound < top) {
            if (kept_above(&t, max_nodes, bound)) break;
        }
        left -= prob;
        PyObject *st = PySequence_Tuple(PyList_GET_ITEM(segs, k));
        if (!st) goto fail;
        PyObject *res = PyObject_CallFunctionObjArgs(candidate, tail, st, NULL);
        Py_DECREF(st);
        if (!res) goto fail;
        if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 2) {
            Py_DECREF(res);
            PyErr_SetString(PyExc_TypeError, "candidate must return (ids, labels)");
            goto fail;
        }
        PyObject *ids = PySequence_Fast(PyTuple_GET_ITEM(res, 0), "ids");
        PyObject *labs = ids ? PySequence_Fast(PyTuple_GET_ITEM(res, 1), "labels") : NULL;
        if (!labs) {
            Py_XDECREF(ids);
            Py_DECREF(res);
            goto fail;
        }
        Py_ssize_t m = PySequence_Fast_GET_SIZE(ids);
        if (m > max_tokens) m = max_tokens;
        if (PySequence_Fast_GET_SIZE(labs) < m) m = PySequence_Fast_GET_SIZE(labs);
        if (m > chain_cap) {
            chain_cap = m * 2;
            int64_t *c2 = realloc(chain, chain_cap * sizeof(int64_t));
            if (!c2) {
                Py_DECREF(ids);
                Py_DECREF(labs);
                Py_DECREF(res);
                goto nomem;
            }
            chain = c2;
        }
        long node = -1;
        int err = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            long tok = PyLong_AsLong(PySequence_Fast_GET_ITEM(ids, j));
            if (tok == -1 && PyErr_Occurred()) {
                err = 1;
                break;
            }
            int64_t nxt = find(&t, node, tok);
            if (nxt < 0) {
                if (t.n == t.cap && grow_nodes(&t) < 0) {
                    PyErr_NoMemory();
                    err = 1;
                    break;
                }
                nxt = t.n;
                PyObject *lab = PySequence_Fast_GET_ITEM(labs, j);
                if (PyList_Append(labels, lab) < 0) {
                    err = 1;
                    break;
                }
                PyObject *plab = node >= 0 ? t.label[node] : Py_None;
                double r = 0.0;
                int found = 0;
                for (int q = 0; q < nrates; q++) {
                    if (rates[q].lab == lab && rates[q].plab == plab) {
                        r = rates[q].r;
                        found = 1;
                        break;
                    }
                }
                if (!found) {
                    PyObject *rv = PyObject_CallFunctionObjArgs(rate, lab, plab, NULL);
                    if (!rv) {
                        err = 1;
                        break;
                    }
                    r = PyFloat_AsDouble(rv);
                    Py_DECREF(rv);
                    if (r == -1.0 && PyErr_Occurred()) {
                        err = 1;
                        break;
                    }
                    if (nrates < 64) {
                        rates[nrates].lab = lab;
                        rates[nrates].plab = plab;
                        rates[nrates].r = r;
                        nrates++;
                    }
                }
                t.tok[nxt] = tok;
                t.par[nxt] = node;
                t.label[nxt] = lab; /* kept alive by ``labels`` */
                t.mass[nxt] = 0.0;
                t.node_rate[nxt] = r;
                t.path_rate[nxt] = r * (node < 0 ? 1.0 : t.path_rate[node]);
                t.n++;
                if (insert(&t, node, tok, nxt) < 0) {
                    PyErr_NoMemory();
                    err = 1;
                    break;
                }
            }
            chain[j] = nxt;
            node = (long)nxt;
        }
        Py_DECREF(ids);
        Py_DECREF(labs);
        Py_DECREF(res);
        if (err) goto fail;
        for (Py_ssize_t j = 0; j < m; j++) {
            int64_t i = chain[j];
            t.mass[i] += prob;
            if (t.mass[i] > top) top = t.mass[i];
        }
    }
    {
        PyObject *tokens = PyList_New(t.n), *parents = PyList_New(t.n), *conf = PyList_New(t.n);
        PyObject *kids = PyDict_New();
        if (!tokens || !parents || !conf || !kids) {
            Py_XDECREF(tokens);
            Py_XDECREF(parents);
            Py_XDECREF(conf);
            Py_XDECREF(kids);
            goto fail;
        }
        for (int64_t i = 0; i < t.n; i++) {
            long p = t.par[i];
            double denom = 1.0;
            if (p >= 0) denom = (1e-12 > t.mass[p]) ? 1e-12 : t.mass[p];
            double share = t.mass[i] / denom;
            double c = (share < 1.0 ? share : 1.0) * t.node_rate[i];
            PyObject *pt = PyLong_FromLong(t.tok[i]);
            PyObject *pp = PyLong_FromLong(p);
            PyObject *pc = PyFloat_FromDouble(c);
            PyObject *pi = PyLong_FromLongLong(i);
            PyObject *key = (pt && pp) ? PyTuple_Pack(2, pp, pt) : NULL;
            if (!pt || !pp || !pc || !pi || !key || PyDict_SetItem(kids, key, pi) < 0) {
                Py_XDECREF(pt);
                Py_XDECREF(pp);
                Py_XDECREF(pc);
                Py_XDECREF(pi);
                Py_XDECREF(key);
                Py_DECREF(tokens);
                Py_DECREF(parents);
                Py_DECREF(conf);
                Py_DECREF(kids);
                goto fail;
            }
            Py_DECREF(key);
            Py_DECREF(pi);
            PyList_SET_ITEM(tokens, i, pt);
            PyList_SET_ITEM(parents, i, pp);
            PyList_SET_ITEM(conf, i, pc);
        }
        result = PyTuple_Pack(5, tokens, parents, conf, labels, kids);
        Py_DECREF(tokens);
        Py_DECREF(parents);
        Py_DECREF(conf);
        Py_DECREF(kids);
    }
    Py_DECREF(labels);
    tree_free(&t);
    free(chain);
    return result;
nomem:
    PyErr_NoMemory();
fail:
    Py_DECREF(labels);
    tree_free(&t);
    free(chain);
    return NULL;
}

static PyMethodDef methods[] = {
    {"merge", merge, METH_VARARGS, "Merge tokenized candidates into one draft tree (candidates_to_tree)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "toolspec_tree_merge", NULL, -1, methods};

PyMODINIT_FUNC PyInit_toolspec_tree_merge(void) { return PyModule_Create(&module); }
