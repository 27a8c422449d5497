/* Prints the offsets fleetd/trace/enrich/pyframes.py LAYOUTS holds, measured with offsetof
 * against one CPython's own (internal) headers: tests/unit/test_pyframes_layouts.py
 * compiles it once per installed interpreter and compares. "name=value" per line. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#if PY_MINOR_VERSION >= 11
#include "internal/pycore_frame.h"
#else
#include "frameobject.h"
#endif

#define P(name, v) printf("%s=%lu\n", name, (unsigned long)(v))

int main(void)
{
    P("runtime_interp_head", offsetof(_PyRuntimeState, interpreters.head));
#if PY_MINOR_VERSION >= 11
    P("interp_threads_head", offsetof(PyInterpreterState, threads.head));
#else
    P("interp_threads_head", offsetof(PyInterpreterState, tstate_head));
#endif
    P("tstate_next", offsetof(PyThreadState, next));
#if PY_MINOR_VERSION >= 11
    P("tstate_tid", offsetof(PyThreadState, native_thread_id));
#else
    P("tstate_tid", offsetof(PyThreadState, thread_id)); /* pthread_t: see pyframes */
#endif
#if PY_MINOR_VERSION >= 13
    P("tstate_frame", offsetof(PyThreadState, current_frame));
#elif PY_MINOR_VERSION >= 11
    P("tstate_frame", offsetof(PyThreadState, cframe));
    P("cframe_frame", offsetof(_PyCFrame, current_frame));
#else
    P("tstate_frame", offsetof(PyThreadState, frame));
#endif
#if PY_MINOR_VERSION >= 13
    P("frame_code", offsetof(_PyInterpreterFrame, f_executable));
    P("frame_instr", offsetof(_PyInterpreterFrame, instr_ptr));
#elif PY_MINOR_VERSION >= 11
    P("frame_code", offsetof(_PyInterpreterFrame, f_code));
    P("frame_instr", offsetof(_PyInterpreterFrame, prev_instr));
#else
    P("frame_code", offsetof(PyFrameObject, f_code));
    P("frame_instr", offsetof(PyFrameObject, f_lasti));
    P("frame_previous", offsetof(PyFrameObject, f_back));
#endif
#if PY_MINOR_VERSION >= 11
    P("frame_previous", offsetof(_PyInterpreterFrame, previous));
    P("frame_owner", offsetof(_PyInterpreterFrame, owner));
    P("code_qualname", offsetof(PyCodeObject, co_qualname));
    P("code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#else
    P("code_qualname", offsetof(PyCodeObject, co_name));
#endif
#if PY_MINOR_VERSION >= 12
    P("owner_skip", FRAME_OWNED_BY_CSTACK);
#endif
    P("code_filename", offsetof(PyCodeObject, co_filename));
    P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("code_linetable", offsetof(PyCodeObject, co_linetable));
    P("bytes_data", offsetof(PyBytesObject, ob_sval));
    P("var_size", offsetof(PyVarObject, ob_size));
    P("str_length", offsetof(PyASCIIObject, length));
    P("str_state", offsetof(PyASCIIObject, state));
    P("str_ascii_data", sizeof(PyASCIIObject));
    P("str_compact_data", sizeof(PyCompactUnicodeObject));
#if PY_MINOR_VERSION >= 12
    P("gil", offsetof(PyInterpreterState, _gil)); /* per interpreter from 3.12 */
#else
    P("gil", offsetof(_PyRuntimeState, ceval.gil));
#endif
    P("gil_size", sizeof(struct _gil_runtime_state));
    return 0;
}
