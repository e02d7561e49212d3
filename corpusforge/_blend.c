/* The blending indices in plain C: the compiled half of corpusforge/data/blended.py (_fill_blocks there is the
 * same algorithm in numba, used where this extension is not built).
 *
 * fill_blocks(dataset_index, dataset_sample_index, weights, limits)
 *   dataset_index: a writable buffer of int16, one per sample of the blend (its length is the blend's size);
 *   dataset_sample_index: a writable buffer of as many int64;
 *   weights: float64, one per dataset; limits: int64, one per dataset (the samples it may give; past the size for
 *   helpers.cpp's build_blending_indices, its sizes for build_exhaustive_blending_indices).
 *   At each step the dataset with the largest error w_d * max(i, 1) - count_d gets the sample, ties to the lowest d,
 *   a dataset whose count reaches its limit leaving the race; each block of sqrt(D) steps scans only the datasets
 *   that can win in it (the argument is in blended.py, above _fill_blocks).
 *
 * Why: numba's start-up costs ~0.5-1 s of CPU in a fresh process (prepare-cache, a job's first index build), more
 * than the blend of 2M samples of 2,500 datasets itself. The errors are computed as helpers.cpp computes them (one
 * multiply, one subtract, in double; built with -ffp-contract=off so that no fused multiply-add rounds differently).
 * The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The k-th smallest of x[0..n) (0-based); x is reordered. Hoare's selection: only the value is used, which any
 * selection algorithm gives (np.partition's arrangement does not matter). */
static double select_kth(double *x, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        double pivot = x[lo + (hi - lo) / 2];
        Py_ssize_t a = lo, b = hi;
        while (a <= b) {
            while (x[a] < pivot) a++;
            while (x[b] > pivot) b--;
            if (a <= b) {
                double t = x[a];
                x[a] = x[b];
                x[b] = t;
                a++;
                b--;
            }
        }
        if (k <= b)
            hi = b;
        else if (k >= a)
            lo = a;
        else
            return x[k];
    }
    return x[k];
}

/* scratch: 5 doubles and 3 int64 per dataset. */
static void fill_blocks(int16_t *dataset_index, int64_t *dataset_sample_index, const double *weights,
                        const int64_t *limits, Py_ssize_t d, Py_ssize_t size, char *scratch) {
    double *count = (double *)scratch, *pre_error = count + d, *sel = pre_error + d, *weight = sel + d;
    double *counted = weight + d;
    int64_t *taken = (int64_t *)(counted + d), *pre = taken + d, *candidates = pre + d;
    Py_ssize_t block = (Py_ssize_t)sqrt((double)d);
    if (block < 8) block = 8;
    for (Py_ssize_t k = 0; k < d; k++) {
        taken[k] = 0;
        count[k] = limits[k] > 0 ? 0.0 : INFINITY; /* count_d as helpers.cpp's double; inf once out of the race */
    }
    double low = -INFINITY; /* only datasets whose error may reach this by the block's end are looked at */
    Py_ssize_t i = 0;
    while (i < size) {
        Py_ssize_t stop = size < i + block ? size : i + block, picks = stop - i, m, above, n = 0;
        double first = i > 1 ? (double)i : 1.0, last = stop - 1 > 1 ? (double)(stop - 1) : 1.0;
        for (;;) { /* one pass over the datasets; a second, over all, if `low` kept fewer than `picks` above it */
            m = above = 0;
            for (Py_ssize_t k = 0; k < d; k++) {
                if (weights[k] * last - count[k] >= low) {
                    pre[m] = k;
                    pre_error[m] = weights[k] * first - count[k];
                    above += pre_error[m] >= low;
                    m++;
                }
            }
            if (above >= picks || low == -INFINITY) break;
            low = -INFINITY;
        }
        if (above >= picks) { /* floor: the picks-th largest error at the first step */
            memcpy(sel, pre_error, m * sizeof(double));
            double floor_ = select_kth(sel, m, m - picks), top = floor_;
            for (Py_ssize_t c = 0; c < m; c++) {
                if (pre_error[c] > top) top = pre_error[c];
                if (weights[pre[c]] * last - count[pre[c]] >= floor_) candidates[n++] = pre[c];
            }
            low = floor_ - (top - floor_); /* the next block's floor is near this one */
        } else { /* fewer datasets in the race than picks: all of them */
            for (Py_ssize_t c = 0; c < m; c++)
                if (count[pre[c]] < INFINITY) candidates[n++] = pre[c];
        }
        for (Py_ssize_t c = 0; c < n; c++) {
            weight[c] = weights[candidates[c]];
            counted[c] = count[candidates[c]];
        }
        for (Py_ssize_t j = i; j < stop; j++) {
            double step = j > 1 ? (double)j : 1.0;
            Py_ssize_t best = 0;
            double best_error = weight[0] * step - counted[0]; /* helpers.cpp: weights[d] * double(i) - count */
            for (Py_ssize_t c = 1; c < n; c++) {
                double error = weight[c] * step - counted[c];
                if (error > best_error) {
                    best = c;
                    best_error = error;
                }
            }
            int64_t k = candidates[best];
            dataset_index[j] = (int16_t)k;
            dataset_sample_index[j] = taken[k];
            taken[k] += 1;
            count[k] = counted[best] = taken[k] < limits[k] ? (double)taken[k] : INFINITY;
        }
        i = stop;
    }
}

static PyObject *py_fill_blocks(PyObject *self, PyObject *args) {
    Py_buffer index, sample_index, weights, limits;
    if (!PyArg_ParseTuple(args, "w*w*y*y*", &index, &sample_index, &weights, &limits)) return NULL;
    PyObject *result = NULL;
    char *scratch = NULL;
    Py_ssize_t size = index.len / (Py_ssize_t)sizeof(int16_t), d = weights.len / (Py_ssize_t)sizeof(double);
    if (!PyBuffer_IsContiguous(&index, 'C') || !PyBuffer_IsContiguous(&sample_index, 'C') ||
        !PyBuffer_IsContiguous(&weights, 'C') || !PyBuffer_IsContiguous(&limits, 'C')) {
        PyErr_SetString(PyExc_ValueError, "fill_blocks: every buffer must be contiguous");
        goto done;
    }
    if (sample_index.len != size * (Py_ssize_t)sizeof(int64_t) || limits.len != d * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "fill_blocks: int16 and int64 per sample; float64 and int64 per dataset");
        goto done;
    }
    if (size > 0 && (d < 1 || d > 32767)) {
        PyErr_SetString(PyExc_ValueError, "fill_blocks: 1 to 32767 datasets (the dataset index is int16)");
        goto done;
    }
    if (size > 0) {
        if (!(scratch = PyMem_Malloc(d * (5 * sizeof(double) + 3 * sizeof(int64_t))))) {
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        fill_blocks((int16_t *)index.buf, (int64_t *)sample_index.buf, (const double *)weights.buf,
                    (const int64_t *)limits.buf, d, size, scratch);
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&index);
    PyBuffer_Release(&sample_index);
    PyBuffer_Release(&weights);
    PyBuffer_Release(&limits);
    return result;
}

static PyMethodDef methods[] = {
    {"fill_blocks", py_fill_blocks, METH_VARARGS,
     "fill_blocks(dataset_index, dataset_sample_index, weights, limits): the blending indices, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blend", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blend(void) { return PyModule_Create(&module); }
