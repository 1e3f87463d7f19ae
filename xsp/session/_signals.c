/* Stopping signals that land on another thread, sent on to the main one.
 *
 * While a session runs, SIGTERM, SIGHUP and SIGINT have a Python handler (xsp/session/signals.py).
 * Python runs handlers in the main thread only: CPython's C handler notes the signal on whatever
 * thread the kernel picked, and the main thread runs the Python handler at its next bytecode. A
 * main thread that is waiting in a call which only a signal to it interrupts (an idle Pool
 * worker waiting for its next task in a semaphore) never gets there when the kernel picked
 * another thread (one of Arrow's, an OpenMP worker, a thread of the program's): the signal is
 * noted and nothing runs. Left to the default action the signal would have ended the process on
 * any thread; here Pool.terminate() waited forever for such a worker.
 *
 * send_to_main_thread(signum) puts this module's C handler in front of CPython's for that signal:
 * on the main thread it calls CPython's handler; on any other it sends the signal on to the main
 * thread (pthread_kill, safe in a handler), which then wakes with EINTR and runs the Python
 * handler as if the kernel had picked it. signal.signal() for that signal later installs CPython's
 * own handler again, and with it the usual behaviour.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>

static pthread_t main_thread;
/* CPython's action for each signal sent on, called on the main thread. */
static struct sigaction python_actions[NSIG];

static void call_python_action(int signum, siginfo_t *info, void *context) {
    const struct sigaction *action = &python_actions[signum];
    if (action->sa_flags & SA_SIGINFO)
        action->sa_sigaction(signum, info, context);
    else if (action->sa_handler != SIG_DFL && action->sa_handler != SIG_IGN)
        action->sa_handler(signum);
}

static void on_signal(int signum, siginfo_t *info, void *context) {
    if (!pthread_equal(pthread_self(), main_thread)) {
        int saved_errno = errno;
        int failed = pthread_kill(main_thread, signum);
        errno = saved_errno;
        if (!failed)
            return;
    }
    call_python_action(signum, info, context);
}

/* In a forked child, the thread that forked is the only one, and Python's main thread. */
static void after_fork_in_child(void) { main_thread = pthread_self(); }

static PyObject *send_to_main_thread(PyObject *module, PyObject *argument) {
    long signum = PyLong_AsLong(argument);
    if (signum == -1 && PyErr_Occurred())
        return NULL;
    if (signum <= 0 || signum >= NSIG) {
        PyErr_Format(PyExc_ValueError, "signal number %ld out of range", signum);
        return NULL;
    }
    struct sigaction current;
    sigset_t blocked;
    if (sigaction((int)signum, NULL, &current) != 0 || pthread_sigmask(SIG_BLOCK, NULL, &blocked) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_signal)
        Py_RETURN_TRUE;
    /* nothing to send on to: no handler of Python's, or a main thread that blocks the signal (it
     * would stay pending there, where CPython's handler on another thread still notes it) */
    if (!(current.sa_flags & SA_SIGINFO) && (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN))
        Py_RETURN_FALSE;
    if (sigismember(&blocked, (int)signum) == 1)
        Py_RETURN_FALSE;
    struct sigaction ours = current;
    ours.sa_flags |= SA_SIGINFO;
    ours.sa_sigaction = on_signal;
    main_thread = pthread_self();
    python_actions[signum] = current;
    if (sigaction((int)signum, &ours, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"send_to_main_thread", send_to_main_thread, METH_O,
     "send_to_main_thread(signum) -> bool\n\nCalled on the main thread, once signal.signal() gave signum a "
     "Python handler: the signal, where it lands on another thread, is sent on to this one. False where "
     "there is nothing to send on (no Python handler, or the signal blocked on this thread)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "xsp.session._signals",
    "Stopping signals that land on another thread, sent on to the main one.", -1, methods,
};

PyMODINIT_FUNC PyInit__signals(void) {
    main_thread = pthread_self();
    if (pthread_atfork(NULL, NULL, after_fork_in_child) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    return PyModule_Create(&module);
}
