/* The eval and abort callbacks llama.cpp calls on every graph node, answered in C.

   ggml asks the eval callback (ask = true) about every node of a graph, and the CPU backend's
   thread 0 calls the abort callback after every node it computes, while the other threads wait at
   the next barrier. A decode of a large MoE model has thousands of nodes, and a Python callback
   costs a GIL round trip each time. Here both are answered in C: the eval callback hands Python
   (`forward`) only the nodes whose names bmoe.seam.eval_hook.EvalHook stops at (the routing's
   `ffn_moe_weights-L`, the router input `ffn_moe_logits-L` while wanted, the down matmul's inputs
   while wanted) and every node while it captures; the abort callback answers from a flag Python
   sets when it parks an error (or for a dry capture), and asks Python itself at most once per `abort_ns`, so a signal's
   Python handler still runs within that time during a long graph. Python's answers are the
   decisions; this file only spares the calls whose answer is known to be false.

   The struct is `EvalFilter` in bmoe/seam/eval_filter.py (ctypes), field for field; the name's
   offset in struct ggml_tensor comes from the seam's own mirror, pinned by tests/test_seam.py. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_STEMS 8
#define STEM_LEN 48

typedef bool (*eval_fn)(void *tensor, bool ask, void *user);
typedef bool (*abort_fn)(void *user);

struct eval_filter {
    eval_fn forward;            /* Python's eval callback, for the nodes it decides */
    abort_fn forward_abort;     /* Python's abort callback */
    int64_t abort_ns;           /* ask Python's abort callback at most this often */
    int64_t abort_last;         /* CLOCK_MONOTONIC ns of the last time it was asked */
    int32_t name_offset;        /* offsetof(struct ggml_tensor, name) */
    int32_t every;              /* 1: hand Python every node (the warm-up capture) */
    int32_t stop;               /* 1: an error is parked: stop the graph, ask nothing */
    int32_t halt;               /* 1: stop the graph after the node being computed (a dry capture) */
    int32_t routing;            /* 1: hand Python each ffn_moe_weights-L node */
    int32_t router_input;       /* 1: hand Python each ffn_moe_logits-L node */
    int32_t n_stems;            /* down-matmul input names, without their "-L" */
    char stems[MAX_STEMS][STEM_LEN];
};

static bool starts(const char *s, const char *prefix, size_t n) { return strncmp(s, prefix, n) == 0; }

/* "STEM-<digits>" and nothing after the digits */
static bool stem_of_layer(const char *name, const char *stem) {
    size_t n = strlen(stem);
    if (strncmp(name, stem, n) != 0 || name[n] != '-' || name[n + 1] == '\0') return false;
    for (const char *p = name + n + 1; *p; p++)
        if (*p < '0' || *p > '9') return false;
    return true;
}

static bool wanted(const struct eval_filter *f, const char *name) {
    if (!starts(name, "ffn_moe_", 8)) return false;
    if (f->routing && stem_of_layer(name, "ffn_moe_weights")) return true;
    if (f->router_input && stem_of_layer(name, "ffn_moe_logits")) return true;
    for (int i = 0; i < f->n_stems; i++)
        if (stem_of_layer(name, f->stems[i])) return true;
    return false;
}

bool bmoe_eval_filter(void *tensor, bool ask, void *user) {
    struct eval_filter *f = (struct eval_filter *)user;
    if (f->stop) return false;
    if (f->every || wanted(f, (const char *)tensor + f->name_offset)) return f->forward(tensor, ask, user);
    return false;
}

bool bmoe_abort_filter(void *user) {
    struct eval_filter *f = (struct eval_filter *)user;
    if (f->stop || f->halt) return true;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    if (now - f->abort_last < f->abort_ns) return false;
    f->abort_last = now;
    return f->forward_abort(user);
}

/* sizeof(struct eval_filter) and each field's offsetof by its name (-1: no such field): bmoe.seam.eval_filter's
   ctypes mirror is checked against them, field by field, when the filter is loaded */
size_t bmoe_filter_size(void) { return sizeof(struct eval_filter); }

long bmoe_filter_offset(const char *field) {
#define AT(f) if (strcmp(field, #f) == 0) return (long)offsetof(struct eval_filter, f);
    AT(forward) AT(forward_abort) AT(abort_ns) AT(abort_last) AT(name_offset) AT(every) AT(stop) AT(halt)
    AT(routing) AT(router_input) AT(n_stems) AT(stems)
#undef AT
    return -1;
}

/* An importable module, so that the build and the package find it like any extension; the two
   functions above are what bmoe uses (through ctypes). */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_eval_filter",
                                    "bmoe's eval and abort callbacks in C (see bmoe.seam.eval_filter).", -1, NULL};

PyMODINIT_FUNC PyInit__eval_filter(void) { return PyModule_Create(&module); }
