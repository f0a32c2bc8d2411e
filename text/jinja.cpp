// jinja2 through CPython's C API (text/jinja.h). The Python side is the
// module below; the C++ side starts the interpreter once, holds Python's
// global lock only while it calls in, and bounds a render's time with one
// watchdog thread for the process that raises an exception in a rendering
// thread past its deadline.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "text/jinja.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <initializer_list>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "text/chat_template.h"

namespace disagg::gpu {
namespace {

// The environment as transformers' _compile_jinja_template builds it, plus
// the bounds. Errors the template or its data cause are TemplateError
// (raise_exception), LimitError (a bound) or jinja2's own.
constexpr const char* kModule = R"PY(
import datetime
import json
import threading

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    pass


class LimitError(Exception):
    pass


class Interrupted(BaseException):
    """Raised by the watchdog in a compile or render past its time (and again
    until it returns): a BaseException, which no `except Exception` of
    jinja2's (constant folding, the sandbox's getitem) or a filter's
    swallows."""


def raise_exception(message):
    raise TemplateError(message)


def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Generation(Extension):
    """{% generation %}...{% endgeneration %}: marks the assistant's part for
    training masks; a prompt renders the body as it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


BOUND = threading.local()  # this thread's output bound (renders of threads interleave), set before any call


# The most bits an integer a template computes may have: one C call on big
# integers (a power, a product) runs to its end whatever the watchdog says.
INT_BITS = 1 << 16


class Bounded(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            characters = BOUND.characters
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > characters:
                    raise LimitError("a repetition longer than the output bound of %d characters" % characters)
            if ints and abs(left).bit_length() + abs(right).bit_length() > INT_BITS:
                raise LimitError("a product of more than %d bits" % INT_BITS)
        if operator == "**" and ints and abs(left) > 1 and right > 0 and (abs(left).bit_length() - 1 or 1) * right > INT_BITS:
            raise LimitError("a power of more than %d bits (an exponent too large for its base)" % INT_BITS)
        return super().call_binop(context, operator, left, right)


ENV = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
ENV.globals["raise_exception"] = raise_exception
ENV.globals["strftime_now"] = strftime_now
ENV.filters["tojson"] = tojson


def compile_template(source, characters):
    BOUND.characters = characters  # (constant folding runs filters as it compiles)
    return ENV.from_string(source)


def render(template, context_json, characters):
    BOUND.characters = characters
    out = []
    size = 0
    for chunk in template.generate(**json.loads(context_json)):
        size += len(chunk)
        if size > characters:
            raise LimitError("the rendered prompt passed the output bound of %d characters" % characters)
        out.append(chunk)
    return "".join(out)


def message(error):
    if isinstance(error, jinja2.TemplateSyntaxError):
        return "%s (line %d)" % (error.message, error.lineno)
    return str(error)
)PY";

// Python's heap, bounded: every block it allocates for objects and through
// PyMem_Malloc (the "obj" and "mem" domains) is counted while it lives, its
// size in a header of its own; past
// kPythonHeapBytes an allocation fails and Python raises MemoryError in the
// template that asked. What it bounds is one C call the watchdog cannot
// stop: a 40-byte template asking for gigabytes ('x' | indent(10**11),
// '%0100000000000d' % 1, even folded as a constant while it compiles) or a
// string doubled in a loop. (Python starts in 20-30 MB.)
constexpr size_t kPythonHeapBytes = size_t(256) << 20;
constexpr size_t kBlockHeader = 16;  // (keeps the blocks' 16-byte alignment)

std::atomic<size_t> g_python_heap{0};
PyMemAllocatorEx g_inner[2];  // mem, obj: the allocators the counting ones wrap

bool reserve(size_t bytes) {
  if (g_python_heap.fetch_add(bytes) + bytes <= kPythonHeapBytes) return true;
  g_python_heap.fetch_sub(bytes);
  return false;
}

void* with_header(void* block, size_t size) {
  if (!block) return nullptr;
  *static_cast<size_t*>(block) = size;
  return static_cast<char*>(block) + kBlockHeader;
}

void* counted_malloc(void* ctx, size_t size) {
  auto* inner = static_cast<PyMemAllocatorEx*>(ctx);
  if (size > kPythonHeapBytes || !reserve(size)) return nullptr;
  void* block = with_header(inner->malloc(inner->ctx, size + kBlockHeader), size);
  if (!block) g_python_heap.fetch_sub(size);
  return block;
}

void* counted_calloc(void* ctx, size_t count, size_t each) {
  auto* inner = static_cast<PyMemAllocatorEx*>(ctx);
  if (each != 0 && count > kPythonHeapBytes / each) return nullptr;
  const size_t size = count * each;
  if (!reserve(size)) return nullptr;
  void* block = with_header(inner->calloc(inner->ctx, 1, size + kBlockHeader), size);
  if (!block) g_python_heap.fetch_sub(size);
  return block;
}

void* counted_realloc(void* ctx, void* at, size_t size) {
  if (!at) return counted_malloc(ctx, size);
  auto* inner = static_cast<PyMemAllocatorEx*>(ctx);
  char* block = static_cast<char*>(at) - kBlockHeader;
  const size_t old = *reinterpret_cast<size_t*>(block);
  if (size > kPythonHeapBytes || (size > old && !reserve(size - old))) return nullptr;
  void* moved = with_header(inner->realloc(inner->ctx, block, size + kBlockHeader), size);
  if (!moved) {
    if (size > old) g_python_heap.fetch_sub(size - old);
    return nullptr;
  }
  if (size < old) g_python_heap.fetch_sub(old - size);
  return moved;
}

void counted_free(void* ctx, void* at) {
  if (!at) return;
  auto* inner = static_cast<PyMemAllocatorEx*>(ctx);
  char* block = static_cast<char*>(at) - kBlockHeader;
  g_python_heap.fetch_sub(*reinterpret_cast<size_t*>(block));
  inner->free(inner->ctx, block);
}

// Between Python's preinitialization and its initialization (no block
// exists yet that lacks a header). Not the "raw" domain: Python allocates a
// thread's state there whenever a thread takes its lock anew (every render,
// the watchdog at a deadline), and one refused aborts the process
// (Py_FatalError); the objects a template makes are the obj domain's
// (pymalloc hands its large blocks on to raw: counted once, as obj's).
void count_python_heap() {
  const PyMemAllocatorDomain domains[2] = {PYMEM_DOMAIN_MEM, PYMEM_DOMAIN_OBJ};
  for (int i = 0; i < 2; ++i) {
    PyMem_GetAllocator(domains[i], &g_inner[i]);
    PyMemAllocatorEx counting{&g_inner[i], counted_malloc, counted_calloc, counted_realloc, counted_free};
    PyMem_SetAllocator(domains[i], &counting);
  }
}

// The interpreter and the module's functions, made once per process.
struct Python {
  PyObject* compile = nullptr;  // compile_template(source, characters)
  PyObject* render = nullptr;   // render(template, context_json, characters)
  PyObject* message = nullptr;  // message(error)
  PyObject* interrupted = nullptr;  // the class Interrupted, which the watchdog raises
  std::string error;            // non-empty: Python or jinja2 could not be loaded
};

// The current Python exception as text (and cleared); call with the lock held.
std::string take_error(const Python& py) {
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  std::string text = "unknown Python error";
  PyObject* said = value && py.message ? PyObject_CallOneArg(py.message, value) : nullptr;
  if (!said) {
    PyErr_Clear();
    said = value ? PyObject_Str(value) : nullptr;
  }
  if (said) {
    if (const char* utf8 = PyUnicode_AsUTF8(said)) text = utf8;
    PyErr_Clear();
    Py_DECREF(said);
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  return text;
}

const Python& python() {
  static Python py;
  static std::once_flag once;
  std::call_once(once, [] {
    const bool start = !Py_IsInitialized();
    if (start) {
      // Isolated: PYTHONPATH, PYTHONHOME and the user's site-packages are
      // not read; no signal handlers are taken from the process. Its home
      // is the prefix of the libpython it was built with (else Python
      // would look for one beside the first python3 on PATH: a pyenv's).
      PyPreConfig preconfig;
      PyPreConfig_InitIsolatedConfig(&preconfig);
      PyStatus status = Py_PreInitialize(&preconfig);
      if (PyStatus_Exception(status)) {
        py.error = std::string("cannot start Python: ") + (status.err_msg ? status.err_msg : "unknown");
        return;
      }
      count_python_heap();
      PyConfig config;
      PyConfig_InitIsolatedConfig(&config);
      status = PyConfig_SetBytesString(&config, &config.home, DISAGG_PYTHON_HOME);
      if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
      PyConfig_Clear(&config);
      if (PyStatus_Exception(status)) {
        py.error = std::string("cannot start Python: ") + (status.err_msg ? status.err_msg : "unknown");
        return;
      }
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* globals = PyDict_New();
    PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins());
    PyObject* ran = PyRun_String(kModule, Py_file_input, globals, globals);
    if (!ran) {
      py.error = "cannot load jinja2 (Debian's python3-jinja2, scripts/install-deps): " + take_error(py);
    } else {
      Py_DECREF(ran);
      py.compile = PyDict_GetItemString(globals, "compile_template");
      py.render = PyDict_GetItemString(globals, "render");
      py.message = PyDict_GetItemString(globals, "message");
      py.interrupted = PyDict_GetItemString(globals, "Interrupted");
      Py_XINCREF(py.compile);
      Py_XINCREF(py.render);
      Py_XINCREF(py.message);
      Py_XINCREF(py.interrupted);
    }
    Py_DECREF(globals);
    PyGILState_Release(gil);
    // The thread that started Python holds its lock until it lets go.
    if (start) PyEval_SaveThread();
  });
  return py;
}

// Holds Python's global lock for a scope.
class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// How often the watchdog interrupts a call again once it passed its time
// (until it returns: whatever caught the first one).
constexpr auto kInterruptAgain = std::chrono::milliseconds(50);

// Interrupts compiles and renders that run past their time: one thread for
// the process (a call is a watch() and an unwatch(), no thread of its own),
// waiting for the earliest deadline of the calls it watches. At a deadline
// it takes Python's lock and, unless that call has returned, raises
// Interrupted in its thread (Python checks for it between two of its
// steps), and again every kInterruptAgain. Both sides touch a call's entry
// only with Python's lock held (then the watchdog's mutex), so it never
// fires at a call that has returned; the watchdog waits for deadlines
// without Python's lock.
class Watchdog {
 public:
  // The one watchdog (its thread started at first use; never ended: it
  // only waits, and the process's exit stops it).
  static Watchdog& instance() {
    static Watchdog* w = new Watchdog;
    return *w;
  }
  // With Python's lock held, by the rendering thread: a render of `thread`
  // due by `time` from now. Returns its ticket.
  uint64_t watch(unsigned long thread, std::chrono::milliseconds time) {
    std::lock_guard<std::mutex> lock(m_);
    const uint64_t ticket = ++last_;
    renders_.emplace(ticket, Render{thread, std::chrono::steady_clock::now() + time});
    cv_.notify_one();
    return ticket;
  }
  // With Python's lock held, once the render has returned: whether the
  // watchdog fired at it. Its entry is gone after this.
  bool unwatch(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(m_);
    const auto it = renders_.find(ticket);
    const bool fired = it->second.fired;
    renders_.erase(it);
    return fired;
  }

 private:
  struct Render {
    unsigned long thread;  // Python's id of the rendering thread
    std::chrono::steady_clock::time_point deadline;  // the next interruption
    bool fired = false;  // interrupted at least once
  };

  Watchdog() { std::thread([this] { run(); }).detach(); }

  void run() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      // The earliest deadline (none: until a render comes).
      auto due = renders_.end();
      for (auto it = renders_.begin(); it != renders_.end(); ++it)
        if (due == renders_.end() || it->second.deadline < due->second.deadline) due = it;
      if (due == renders_.end()) {
        cv_.wait(lock);
        continue;
      }
      const uint64_t ticket = due->first;
      if (cv_.wait_until(lock, due->second.deadline) != std::cv_status::timeout) continue;  // (a new render, or spurious)
      // Python's lock first, then ours again (the order the renders take them).
      lock.unlock();
      {
        Gil gil;
        std::lock_guard<std::mutex> again(m_);
        const auto it = renders_.find(ticket);
        if (it != renders_.end()) {  // (gone: it returned meanwhile)
          it->second.fired = true;
          it->second.deadline = std::chrono::steady_clock::now() + kInterruptAgain;
          PyThreadState_SetAsyncExc(it->second.thread, python().interrupted);
        }
      }
      lock.lock();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::map<uint64_t, Render> renders_;  // by ticket: the renders running now
  uint64_t last_ = 0;
};

// Calls the module's `function` with `args` (Python's lock held), watched:
// past limits.time it is interrupted. Returns its result, or throws
// ChatTemplateError saying which bound ended it (`doing`: the call, in words).
PyObject* call_watched(const Python& py, PyObject* function, std::initializer_list<PyObject*> args,
                       const JinjaLimits& limits, const char* doing) {
  PyObject* tuple = PyTuple_New(Py_ssize_t(args.size()));
  Py_ssize_t i = 0;
  for (PyObject* arg : args) {
    Py_XINCREF(arg);
    if (tuple) PyTuple_SET_ITEM(tuple, i++, arg);
  }
  PyObject* result = nullptr;
  bool timed_out = false;
  if (tuple && std::all_of(args.begin(), args.end(), [](PyObject* a) { return a != nullptr; })) {
    Watchdog& watchdog = Watchdog::instance();
    const uint64_t ticket = watchdog.watch(PyThread_get_thread_ident(), limits.time);
    result = PyObject_Call(function, tuple, nullptr);
    PyThreadState_SetAsyncExc(PyThread_get_thread_ident(), nullptr);  // one raised after the last step: dropped
    timed_out = watchdog.unwatch(ticket);
  }
  Py_XDECREF(tuple);
  if (result) return result;
  const bool memory = PyErr_ExceptionMatches(PyExc_MemoryError);
  std::string error = take_error(py);
  if (memory)
    error = "the chat template needs more memory than templates may hold (" + std::to_string(kPythonHeapBytes >> 20) +
            " MiB)";
  if (timed_out) error = "the chat template ran past its " + std::to_string(limits.time.count()) + " ms" + doing;
  throw ChatTemplateError{error};
}

// Owns a new reference for a scope.
struct Ref {
  PyObject* p;
  ~Ref() { Py_XDECREF(p); }
};

}  // namespace

// (jinja2 computes constant expressions as it compiles, filters included: a
// compile is watched and bounded as a render is.)
JinjaTemplate::JinjaTemplate(const std::string& source, const JinjaLimits& limits) : compiled_(nullptr) {
  const Python& py = python();
  if (!py.error.empty()) throw ChatTemplateError{py.error};
  Gil gil;
  const Ref text{PyUnicode_FromStringAndSize(source.data(), Py_ssize_t(source.size()))};
  if (!text.p) throw ChatTemplateError{"the chat template is not UTF-8: " + take_error(py)};
  const Ref characters{PyLong_FromSize_t(limits.characters)};
  compiled_ = call_watched(py, py.compile, {text.p, characters.p}, limits, " while it compiled");
}

JinjaTemplate::~JinjaTemplate() {
  if (!compiled_ || !Py_IsInitialized()) return;
  Gil gil;
  Py_DECREF(static_cast<PyObject*>(compiled_));
}

std::string JinjaTemplate::render(const std::string& context_json, const JinjaLimits& limits) const {
  const Python& py = python();
  Gil gil;
  const Ref context{PyUnicode_FromStringAndSize(context_json.data(), Py_ssize_t(context_json.size()))};
  if (!context.p) throw ChatTemplateError{"the template's context is not UTF-8: " + take_error(py)};
  const Ref characters{PyLong_FromSize_t(limits.characters)};
  const Ref rendered{
      call_watched(py, py.render, {static_cast<PyObject*>(compiled_), context.p, characters.p}, limits, "")};
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(rendered.p, &size);
  if (!utf8) throw ChatTemplateError{"the chat template rendered text that is not UTF-8: " + take_error(py)};
  return std::string(utf8, size_t(size));
}

}  // namespace disagg::gpu
