/* A GPTDataset's sample index in plain C: the compiled half of build_sample_index in corpusforge/data/gpt_dataset.py
 * (_sample_starts there is the same walk in numba, _sample_starts_numpy the same rows from numpy; both are used
 * where this extension is not built).
 *
 * fill(sequence_lengths, document_index, seq_length, num_samples, extra, out)
 *   sequence_lengths: int32, one per sequence of the token dataset; document_index: int32 positions into it;
 *   out: a writable C-contiguous buffer of (num_samples + 1) x 2 int32 or int64 (its length says which).
 *   Row j is the (position in the document index, offset in that document) where the sample starting at stream
 *   token j * seq_length starts; the last row where the last sample ends (helpers.cpp: build_sample_idx).
 *
 * Why: a blend of thousands of small datasets builds thousands of small sample indices. numba's start-up costs
 * ~0.5-1 s of CPU in a fresh process (prepare-cache, a job's first index build), and numpy's twin a dozen calls of
 * fixed overhead per dataset (~0.15 ms each at a few thousand documents: 0.4 s for 2,500 datasets); this costs a few
 * microseconds. The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Documents whose lengths the walk gathers at a time (as _GATHER in gpt_dataset.py): the walk then does not wait on
 * random loads. */
#define GATHER 4096

/* The walk of _sample_starts (gpt_dataset.py), row for row; OUT is int32_t or int64_t. Every row it writes is
 * within [0, num_samples]: a row written by a document that does not hold that start is rewritten by the one that
 * does, which comes later. */
#define WALK(OUT)                                                                                                    \
    static void walk_##OUT(const int32_t *lengths_of, const int32_t *documents, int64_t n, int64_t seq_length,       \
                           int64_t num_samples, int64_t extra, OUT *out) {                                           \
        int64_t lengths[GATHER];                                                                                     \
        out[0] = out[1] = 0;                                                                                         \
        if (n == 0) {                                                                                                \
            for (int64_t j = 0; j <= num_samples; j++) out[2 * j] = out[2 * j + 1] = 0;                              \
            return;                                                                                                  \
        }                                                                                                            \
        int64_t inclusive = 1 - extra, j = 1, start = seq_length, end = 0, block = 0;                                \
        while (block < n - 1 && j <= num_samples) {                                                                  \
            int64_t count = n - 1 - block < GATHER ? n - 1 - block : GATHER;                                         \
            for (int64_t k = 0; k < count; k++) lengths[k] = lengths_of[documents[block + k]];                       \
            for (int64_t k = 0; k < count; k++) {                                                                    \
                int64_t begin = end;                                                                                 \
                end += lengths[k];                                                                                   \
                out[2 * j] = (OUT)(block + k);                                                                       \
                out[2 * j + 1] = (OUT)(start - begin);                                                               \
                int64_t here = start < end + inclusive;                                                              \
                j += here;                                                                                           \
                start += seq_length & -here;                                                                         \
                while (start < end + inclusive && j <= num_samples) { /* a document holding more than one start */ \
                    out[2 * j] = (OUT)(block + k);                                                                   \
                    out[2 * j + 1] = (OUT)(start - begin);                                                           \
                    j++;                                                                                             \
                    start += seq_length;                                                                             \
                }                                                                                                    \
                if (j > num_samples) break;                                                                          \
            }                                                                                                        \
            block += count;                                                                                          \
        }                                                                                                            \
        /* The rest are clamped to the last document; a sample running past its end ends at (last, length - extra). \
         */                                                                                                          \
        int64_t last = n - 1, length = lengths_of[documents[last]];                                                  \
        for (; j <= num_samples; j++, start += seq_length) {                                                         \
            out[2 * j] = (OUT)last;                                                                                  \
            out[2 * j + 1] = (OUT)(start + extra > end + length ? length - extra : start - end);                     \
        }                                                                                                            \
    }

WALK(int32_t)
WALK(int64_t)

static PyObject *py_fill(PyObject *self, PyObject *args) {
    Py_buffer lengths, documents, out;
    long long seq_length, num_samples, extra;
    if (!PyArg_ParseTuple(args, "y*y*LLLw*", &lengths, &documents, &seq_length, &num_samples, &extra, &out))
        return NULL;
    PyObject *result = NULL;
    int64_t n = documents.len / (Py_ssize_t)sizeof(int32_t), sequences = lengths.len / (Py_ssize_t)sizeof(int32_t);
    int64_t rows = num_samples + 1;
    if (!PyBuffer_IsContiguous(&lengths, 'C') || !PyBuffer_IsContiguous(&documents, 'C') ||
        !PyBuffer_IsContiguous(&out, 'C')) {
        PyErr_SetString(PyExc_ValueError, "fill: every buffer must be contiguous");
        goto done;
    }
    if (seq_length < 1 || num_samples < 0 || (extra != 0 && extra != 1)) {
        PyErr_SetString(PyExc_ValueError, "fill: seq_length >= 1, num_samples >= 0, extra 0 or 1");
        goto done;
    }
    if (out.len != rows * 2 * (Py_ssize_t)sizeof(int32_t) && out.len != rows * 2 * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "fill: out holds (num_samples + 1) x 2 int32 or int64");
        goto done;
    }
    const int32_t *d = (const int32_t *)documents.buf;
    for (int64_t k = 0; k < n; k++) { /* an index past the lengths would read out of bounds: refused, not read */
        if (d[k] < 0 || d[k] >= sequences) {
            PyErr_Format(PyExc_IndexError, "fill: document_index[%lld] = %d is not a sequence of %lld", (long long)k,
                         (int)d[k], (long long)sequences);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (out.len == rows * 2 * (Py_ssize_t)sizeof(int32_t))
        walk_int32_t((const int32_t *)lengths.buf, d, n, seq_length, num_samples, extra, (int32_t *)out.buf);
    else
        walk_int64_t((const int32_t *)lengths.buf, d, n, seq_length, num_samples, extra, (int64_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&documents);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", py_fill, METH_VARARGS,
     "fill(sequence_lengths, document_index, seq_length, num_samples, extra, out): a sample index, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sample_index", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sample_index(void) { return PyModule_Create(&module); }
