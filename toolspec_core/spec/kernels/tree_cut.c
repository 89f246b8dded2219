/* The batch budget's cut (spec/tree.py: allocate_batch) in C.
 *
 * Every step ranks every node of every decoding sequence's tree by path probability, keeps the
 * best prefix of the ranking by expected tokens per unit of cost and closes each tree's kept set
 * under parents: thousands of nodes at B = 64, a Python sort of tuples and a loop of divisions
 * per node. Every float is computed in the order the Python function computes it (IEEE doubles,
 * no contraction) and the ranking's order is Python's order of (-p, tree, node) tuples, so the cut
 * is the Python one exactly (tests/engine/test_tree.py holds the two equal).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

typedef struct {
    double p;  /* path probability */
    long ti;   /* tree */
    long i;    /* node */
} Ranked;

/* Python's order of (-p, tree, node) tuples: p descending, then tree, then node ascending. */
static int by_rank(const void *a, const void *b) {
    const Ranked *x = a, *y = b;
    double nx = -x->p, ny = -y->p;
    if (nx < ny) return -1;
    if (nx > ny) return 1;
    if (x->ti != y->ti) return x->ti < y->ti ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

static double list_double(PyObject *list, Py_ssize_t k, int *err) {
    double v = PyFloat_AsDouble(PyList_GET_ITEM(list, k));
    if (v == -1.0 && PyErr_Occurred()) *err = 1;
    return v;
}

/* cut(trees, cost, base_rows, max_nodes): trees a list of (parents, conf) list pairs; cost the
 * curve (a list of floats); max_nodes -1 for none. Ranks every node of every tree by path
 * probability (each tree's best max_nodes where capped), keeps the best prefix of the ranking by
 * expected tokens per unit of cost (n = 0 included, the smallest n on ties), closes each tree's
 * kept set under parents. Returns (kept, left_out): kept per tree a sorted list of node indices, or
 * None where every node is kept; left_out the path probability of the best node left out (0.0:
 * none). The same floats in the same order as the Python function. */
static PyObject *cut(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *trees, *cost;
    Py_ssize_t base_rows, max_nodes;
    if (!PyArg_ParseTuple(args, "O!O!nn", &PyList_Type, &trees, &PyList_Type, &cost, &base_rows, &max_nodes))
        return NULL;
    Py_ssize_t nt = PyList_GET_SIZE(trees), total = 0, longest = 0, nc = PyList_GET_SIZE(cost);
    if (nc == 0) {
        PyErr_SetString(PyExc_ValueError, "an empty cost curve");
        return NULL;
    }
    for (Py_ssize_t t = 0; t < nt; t++) {
        PyObject *pair = PyList_GET_ITEM(trees, t);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyList_Check(PyTuple_GET_ITEM(pair, 0)) ||
            !PyList_Check(PyTuple_GET_ITEM(pair, 1)) ||
            PyList_GET_SIZE(PyTuple_GET_ITEM(pair, 0)) != PyList_GET_SIZE(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_TypeError, "trees: (parents, conf) pairs of lists of one length");
            return NULL;
        }
        Py_ssize_t n = PyList_GET_SIZE(PyTuple_GET_ITEM(pair, 0));
        total += n;
        if (n > longest) longest = n;
    }
    Ranked *ranked = malloc((total ? total : 1) * sizeof(Ranked));
    Ranked *own = malloc((longest ? longest : 1) * sizeof(Ranked));
    double *probs = malloc((longest ? longest : 1) * sizeof(double));
    unsigned char *kept = NULL;
    Py_ssize_t *start = malloc((nt + 1) * sizeof(Py_ssize_t));
    PyObject *out = NULL, *keep_lists = NULL;
    int err = 0;
    if (!ranked || !own || !probs || !start) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t nr = 0;
    start[0] = 0;
    for (Py_ssize_t t = 0; t < nt; t++) {
        PyObject *pair = PyList_GET_ITEM(trees, t);
        PyObject *par = PyTuple_GET_ITEM(pair, 0), *conf = PyTuple_GET_ITEM(pair, 1);
        Py_ssize_t n = PyList_GET_SIZE(par);
        start[t + 1] = start[t] + n;
        for (Py_ssize_t i = 0; i < n; i++) { /* path_probs: parents precede children */
            long p = PyLong_AsLong(PyList_GET_ITEM(par, i));
            if (p == -1 && PyErr_Occurred()) goto done;
            if (p >= i || p < -1) {
                PyErr_SetString(PyExc_ValueError, "a parent must precede its child");
                goto done;
            }
            double c = list_double(conf, i, &err);
            if (err) goto done;
            probs[i] = c * (p < 0 ? 1.0 : probs[p]);
        }
        if (max_nodes >= 0 && n > max_nodes) { /* the tree's own best max_nodes, by (-p, node) */
            for (Py_ssize_t i = 0; i < n; i++) own[i] = (Ranked){probs[i], 0, (long)i};
            qsort(own, n, sizeof(Ranked), by_rank);
            for (Py_ssize_t k = 0; k < max_nodes; k++) ranked[nr++] = (Ranked){own[k].p, (long)t, own[k].i};
        } else {
            for (Py_ssize_t i = 0; i < n; i++) ranked[nr++] = (Ranked){probs[i], (long)t, (long)i};
        }
    }
    qsort(ranked, nr, sizeof(Ranked), by_rank);
    /* best_prefix: argmax over n of tokens[n] / cost[base_rows + n] */
    Py_ssize_t limit = nc - 1 - base_rows;
    if (limit > nr) limit = nr;
    if (limit < 0) limit = 0;
    double tokens = (double)nt;
    double best_rate = tokens / list_double(cost, base_rows < nc - 1 ? base_rows : nc - 1, &err);
    if (err) goto done;
    Py_ssize_t best_n = 0;
    for (Py_ssize_t n = 1; n <= limit; n++) {
        tokens = tokens - (-ranked[n - 1].p);
        double rate = tokens / list_double(cost, base_rows + n, &err);
        if (err) goto done;
        if (rate > best_rate) {
            best_n = n;
            best_rate = rate;
        }
    }
    kept = calloc(total ? total : 1, 1);
    if (!kept) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < best_n; k++) kept[start[ranked[k].ti] + ranked[k].i] = 1;
    keep_lists = PyList_New(nt);
    if (!keep_lists) goto done;
    for (Py_ssize_t t = 0; t < nt; t++) {
        PyObject *par = PyTuple_GET_ITEM(PyList_GET_ITEM(trees, t), 0);
        Py_ssize_t n = PyList_GET_SIZE(par), count = 0;
        unsigned char *mine = kept + start[t];
        for (Py_ssize_t i = n - 1; i >= 0; i--) { /* close under parents (ties can leave a child without its parent) */
            if (!mine[i]) continue;
            long p = PyLong_AsLong(PyList_GET_ITEM(par, i));
            if (p >= 0) mine[p] = 1;
        }
        for (Py_ssize_t i = 0; i < n; i++) count += mine[i];
        if (count == n) {
            Py_INCREF(Py_None);
            PyList_SET_ITEM(keep_lists, t, Py_None);
            continue;
        }
        PyObject *lst = PyList_New(count);
        if (!lst) goto done;
        PyList_SET_ITEM(keep_lists, t, lst);
        for (Py_ssize_t i = 0, k = 0; i < n; i++) {
            if (!mine[i]) continue;
            PyObject *v = PyLong_FromSsize_t(i);
            if (!v) goto done;
            PyList_SET_ITEM(lst, k++, v);
        }
    }
    out = Py_BuildValue("(Od)", keep_lists, best_n < nr ? -(-ranked[best_n].p) : 0.0);
done:
    Py_XDECREF(keep_lists);
    free(ranked);
    free(own);
    free(probs);
    free(kept);
    free(start);
    return out;
}

static PyMethodDef methods[] = {
    {"cut", cut, METH_VARARGS, "The batch budget's cut of its trees (allocate_batch)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "toolspec_tree_cut", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_toolspec_tree_cut(void) { return PyModule_Create(&module); }
