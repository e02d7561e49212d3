/* numpy's legacy RandomState.shuffle in plain C: the compiled half of corpusforge/data/mt19937.py.
 *
 * shuffle(x, itemsize, key, pos) -> pos
 *   x: a writable C-contiguous buffer of items of `itemsize` bytes (1, 2, 4, 8 swapped as words, others by memcpy),
 *   shuffled in place;
 *   key: a writable buffer of 624 uint32, the MT19937 state words, updated in place; pos: the position in it (0-624).
 *   Returns the new position. The permutation and the generator's advance are numpy's (mtrand.pyx _shuffle_raw,
 *   distributions.c random_interval for bounds below 2^32, mt19937.c), which the tests check draw for draw.
 *
 * Why: numpy's shuffle calls a function pointer per 32-bit draw and memcpy's each swap (~20 ns an element here);
 * this is ~3 ns (draws taken branch-free before their swaps), and needs no numba (whose start-up costs ~1 s in a
 * fresh process). The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define N 624
#define M 397
#define MATRIX_A 0x9908B0DFU
#define UPPER 0x80000000U
#define LOWER 0x7FFFFFFFU

/* The next 624 words of the recurrence, in place (mt19937_gen). */
static void regenerate(uint32_t *key) {
    int i;
    uint32_t y;
    for (i = 0; i < N - M; i++) {
        y = (key[i] & UPPER) | (key[i + 1] & LOWER);
        key[i] = key[i + M] ^ (y >> 1) ^ (-(y & 1U) & MATRIX_A);
    }
    for (; i < N - 1; i++) {
        y = (key[i] & UPPER) | (key[i + 1] & LOWER);
        key[i] = key[i + M - N] ^ (y >> 1) ^ (-(y & 1U) & MATRIX_A);
    }
    y = (key[N - 1] & UPPER) | (key[0] & LOWER);
    key[N - 1] = key[M - 1] ^ (y >> 1) ^ (-(y & 1U) & MATRIX_A);
}

static inline uint32_t temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9D2C5680U;
    y ^= (y << 15) & 0xEFC60000U;
    y ^= y >> 18;
    return y;
}

/* The smallest all-ones mask >= i. */
static inline uint32_t mask_of(uint32_t i) {
    i |= i >> 1;
    i |= i >> 2;
    i |= i >> 4;
    i |= i >> 8;
    i |= i >> 16;
    return i;
}

/* The draws of Fisher-Yates for i = hi .. lo+1, in swap_with[i - lo - 1]: branch-free, as a rejected draw (j > i)
 * is written and then overwritten by the next one, so no branch depends on the random value (the rejection loop
 * mispredicted about every other draw: ~7 against ~4 ns an element here). Returns the new position. */
static int draw(uint32_t *swap_with, Py_ssize_t lo, Py_ssize_t hi, uint32_t *key, uint32_t *words, int pos) {
    Py_ssize_t i = hi;
    while (i > lo) {
        uint32_t mask = mask_of((uint32_t)i);
        Py_ssize_t stop = (Py_ssize_t)(mask >> 1) > lo ? (Py_ssize_t)(mask >> 1) : lo; /* the mask holds above */
        if (pos == N) {
            regenerate(key);
            for (int k = 0; k < N; k++) words[k] = temper(key[k]);
            pos = 0;
        }
        while (pos < N && i > stop) {
            uint32_t j = words[pos++] & mask;
            swap_with[i - lo - 1] = j;
            i -= (Py_ssize_t)(j <= (uint32_t)i);
        }
    }
    return pos;
}

#define CHUNK 16384 /* draws taken before their swaps: 64 KiB, stays in cache */

#define SWAP_LOOP(T)                                                          \
    for (Py_ssize_t i = hi; i > lo; i--) {                                    \
        uint32_t j = swap_with[i - lo - 1];                                    \
        T t = ((T *)x)[i];                                                     \
        ((T *)x)[i] = ((T *)x)[j];                                             \
        ((T *)x)[j] = t;                                                       \
    }

/* Fisher-Yates over x (n items of `size` bytes) with the stream at (key, pos); returns the new pos. */
static int shuffle_items(char *x, Py_ssize_t n, Py_ssize_t size, char *tmp, uint32_t *swap_with, uint32_t *key,
                         int pos) {
    uint32_t words[N]; /* the tempered outputs of the current block of key */
    if (pos < N)
        for (int k = 0; k < N; k++) words[k] = temper(key[k]);
    for (Py_ssize_t hi = n - 1; hi > 0;) {
        Py_ssize_t lo = hi - CHUNK > 0 ? hi - CHUNK : 0;
        pos = draw(swap_with, lo, hi, key, words, pos);
        switch (size) {
        case 1: SWAP_LOOP(uint8_t) break;
        case 2: SWAP_LOOP(uint16_t) break;
        case 4: SWAP_LOOP(uint32_t) break;
        case 8: SWAP_LOOP(uint64_t) break;
        default:
            for (Py_ssize_t i = hi; i > lo; i--) {
                Py_ssize_t j = swap_with[i - lo - 1];
                memcpy(tmp, x + i * size, size);
                memcpy(x + i * size, x + j * size, size);
                memcpy(x + j * size, tmp, size);
            }
        }
        hi = lo;
    }
    return pos;
}

static PyObject *py_shuffle(PyObject *self, PyObject *args) {
    Py_buffer x, key;
    Py_ssize_t size;
    int pos;
    if (!PyArg_ParseTuple(args, "w*nw*i", &x, &size, &key, &pos)) return NULL;
    PyObject *result = NULL;
    char *tmp = NULL;
    Py_ssize_t n = size > 0 ? x.len / size : 0;
    if (size <= 0 || x.len % size) {
        PyErr_SetString(PyExc_ValueError, "itemsize: does not divide the buffer");
        goto done;
    }
    if (key.len != N * (Py_ssize_t)sizeof(uint32_t)) {
        PyErr_SetString(PyExc_ValueError, "key: 624 uint32 words");
        goto done;
    }
    if (pos < 0 || pos > N) {
        PyErr_SetString(PyExc_ValueError, "pos: 0 to 624");
        goto done;
    }
    if (n - 1 > (Py_ssize_t)0xFFFFFFFFLL) { /* numpy draws 64-bit words above this bound: left to numpy */
        PyErr_SetString(PyExc_ValueError, "x: more than 2^32 items");
        goto done;
    }
    if (!PyBuffer_IsContiguous(&x, 'C')) {
        PyErr_SetString(PyExc_ValueError, "x: not contiguous");
        goto done;
    }
    if (!(tmp = PyMem_Malloc(((size + 3) & ~(Py_ssize_t)3) + CHUNK * sizeof(uint32_t)))) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t *swap_with = (uint32_t *)(tmp + ((size + 3) & ~(Py_ssize_t)3)); /* after the item buffer, aligned */
    Py_BEGIN_ALLOW_THREADS
    pos = shuffle_items((char *)x.buf, n, size, tmp, swap_with, (uint32_t *)key.buf, pos);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(pos);
done:
    PyMem_Free(tmp);
    PyBuffer_Release(&x);
    PyBuffer_Release(&key);
    return result;
}

static PyMethodDef methods[] = {
    {"shuffle", py_shuffle, METH_VARARGS,
     "shuffle(x, itemsize, key, pos) -> pos: numpy's legacy shuffle of x in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mt19937", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mt19937(void) { return PyModule_Create(&module); }
