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
 *
 * A signal the main thread took can still be left unhandled (a CPython race): while the main
 * thread runs the Python handler of a higher-numbered signal (PyTorch's SIGCHLD handler, which a
 * DataLoader leaves in place and a forked Pool worker inherits) and that handler ends in C, a
 * SIGTERM arriving then is noted, but CPython's pass over the noted signals is already past its
 * number, and the semaphore wait it returns to sleeps on. So after each stopping signal handed
 * to CPython, a thread of this module's ("kicker") interrupts the main thread every KICK_INTERVAL_NS
 * with the same signal until the Python handler says it ran (handled()). The handler here takes a
 * kick for what it is (sent by the kicker, to interrupt the wait) and does not hand it to CPython
 * again: the interrupted wait then checks for noted signals and runs the one it had missed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KICK_INTERVAL_NS 100000000L
/* How long a stopping signal whose action was the default waits for the main thread to run its
 * Python handler before the process ends by it as without xsp (give_up_after). */
#define GIVE_UP_NS 5000000000LL
#define MESSAGE_BYTES 1024

static pthread_t main_thread;
/* CPython's action for each signal sent on, called on the main thread. */
static struct sigaction python_actions[NSIG];

/* Stopping signals handed to CPython, and how many of them the Python handler said it ran. */
static atomic_long delivered, handled;
/* The last signal handed to CPython: the one a kick sends. */
static atomic_int kick_signum;
/* Kicks sent and not yet taken by on_signal (merged signals may take fewer). */
static atomic_int kicks_in_flight;
/* on_signal writes a byte here for each signal handed to CPython; the kicker waits on it. */
static int kick_pipe[2] = {-1, -1};
static int kicker_running;
/* Signals whose action was the default: left unhandled for GIVE_UP_NS (a main thread waiting in
 * native code that retries on EINTR: a process group's rendezvous, a collective), the process
 * ends by them with the default action, as it would have at once without xsp, saying so first. */
static atomic_int give_up[NSIG];
static char give_up_message[NSIG][MESSAGE_BYTES];
static atomic_size_t give_up_length[NSIG];

static void call_python_action(int signum, siginfo_t *info, void *context) {
    const struct sigaction *action = &python_actions[signum];
    if (action->sa_flags & SA_SIGINFO)
        action->sa_sigaction(signum, info, context);
    else if (action->sa_handler != SIG_DFL && action->sa_handler != SIG_IGN)
        action->sa_handler(signum);
}

static int is_kick(const siginfo_t *info) {
#ifdef SI_TKILL
    if (info == NULL || info->si_code != SI_TKILL || info->si_pid != getpid())
        return 0;
    int in_flight = atomic_load(&kicks_in_flight);
    while (in_flight > 0)
        if (atomic_compare_exchange_weak(&kicks_in_flight, &in_flight, in_flight - 1))
            return 1;
#else
    (void)info;
#endif
    return 0;
}

static void on_signal(int signum, siginfo_t *info, void *context) {
    int saved_errno = errno;
    if (!pthread_equal(pthread_self(), main_thread)) {
        int failed = pthread_kill(main_thread, signum);
        if (!failed) {
            errno = saved_errno;
            return;
        }
    } else if (is_kick(info)) {  /* its work is done: the main thread's wait was interrupted */
        errno = saved_errno;
        return;
    }
    call_python_action(signum, info, context);
    atomic_store(&kick_signum, signum);
    atomic_fetch_add(&delivered, 1);
    if (kick_pipe[1] >= 0) {
        char byte = 0;
        if (write(kick_pipe[1], &byte, 1) < 0) { /* full: the kicker has bytes to read already */ }
    }
    errno = saved_errno;
}

/* Still this module's handler for signum (signal.signal() may have put another in its place). */
static int ours(int signum) {
    struct sigaction current;
    return sigaction(signum, NULL, &current) == 0 && (current.sa_flags & SA_SIGINFO) &&
           current.sa_sigaction == on_signal;
}

static long long monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* End the process by signum with its default action, as it would have ended without xsp. */
static void end_as_without_xsp(int signum) {
    size_t length = atomic_load(&give_up_length[signum]);
    if (length > 0 && write(STDERR_FILENO, give_up_message[signum], length) < 0) { /* nowhere to say it */ }
    struct sigaction fallback;
    memset(&fallback, 0, sizeof fallback);
    fallback.sa_handler = SIG_DFL;
    sigemptyset(&fallback.sa_mask);
    sigaction(signum, &fallback, NULL);
    kill(getpid(), signum);
}

static void *kick(void *unused) {
    (void)unused;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    for (;;) {
        char byte;
        ssize_t got = read(kick_pipe[0], &byte, 1);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return NULL;
        long long since_ns = monotonic_ns();
        for (;;) {
            struct timespec pause = {0, KICK_INTERVAL_NS};
            while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {}
            if (atomic_load(&handled) >= atomic_load(&delivered))
                break;
            int signum = atomic_load(&kick_signum);
            if (!ours(signum))
                break;
            if (atomic_load(&give_up[signum]) && monotonic_ns() - since_ns >= GIVE_UP_NS && getpid() != 1) {
                end_as_without_xsp(signum);
                break;
            }
            atomic_fetch_add(&kicks_in_flight, 1);
            if (pthread_kill(main_thread, signum) != 0) {
                atomic_fetch_sub(&kicks_in_flight, 1);
                break;
            }
        }
    }
}

static int start_kicker(void) {
#ifndef SI_TKILL
    return -1; /* a kick could not be told from a signal: none is sent, and the race stays */
#endif
    if (kicker_running)
        return 0;
    if (pipe(kick_pipe) != 0)
        return -1;
    int flags = fcntl(kick_pipe[1], F_GETFL);
    if (flags < 0 || fcntl(kick_pipe[1], F_SETFL, flags | O_NONBLOCK) != 0 ||
        fcntl(kick_pipe[0], F_SETFD, FD_CLOEXEC) != 0 || fcntl(kick_pipe[1], F_SETFD, FD_CLOEXEC) != 0)
        goto failed;
    pthread_t thread;
    pthread_attr_t attributes;
    if (pthread_attr_init(&attributes) != 0)
        goto failed;
    pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attributes, kick, NULL);
    pthread_attr_destroy(&attributes);
    if (failed)
        goto failed;
    kicker_running = 1;
    return 0;
failed:
    close(kick_pipe[0]);
    close(kick_pipe[1]);
    kick_pipe[0] = kick_pipe[1] = -1;
    return -1;
}

/* In a forked child, the thread that forked is the only one, and Python's main thread; the
 * kicker is not there, and its pipe is the parent's: the child's first call starts its own. */
static void after_fork_in_child(void) {
    main_thread = pthread_self();
    if (kick_pipe[0] >= 0) {
        close(kick_pipe[0]);
        close(kick_pipe[1]);
    }
    kick_pipe[0] = kick_pipe[1] = -1;
    kicker_running = 0;
    atomic_store(&delivered, 0);
    atomic_store(&handled, 0);
    atomic_store(&kicks_in_flight, 0);
    for (int signum = 0; signum < NSIG; signum++)  /* the child's signals are its own (StopSignals.forget) */
        atomic_store(&give_up[signum], 0);
}

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
    start_kicker();  /* where no thread can be started, signals still go on: only the race stays */
    if (sigaction((int)signum, &ours, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
}

static PyObject *give_up_after(PyObject *module, PyObject *args) {
    (void)module;
    int signum;
    const char *message = NULL;
    Py_ssize_t length = 0;
    if (!PyArg_ParseTuple(args, "iz#", &signum, &message, &length))
        return NULL;
    if (signum <= 0 || signum >= NSIG) {
        PyErr_Format(PyExc_ValueError, "signal number %d out of range", signum);
        return NULL;
    }
    if (message != NULL) {
        size_t kept = (size_t)length < MESSAGE_BYTES ? (size_t)length : MESSAGE_BYTES;
        atomic_store(&give_up_length[signum], 0);  /* (the kicker reads it only once a signal came) */
        memcpy(give_up_message[signum], message, kept);
        atomic_store(&give_up_length[signum], kept);
    }
    atomic_store(&give_up[signum], message != NULL);
    Py_RETURN_NONE;
}

static PyObject *mark_handled(PyObject *module, PyObject *Py_UNUSED(unused)) {
    (void)module;
    atomic_store(&handled, atomic_load(&delivered));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"send_to_main_thread", send_to_main_thread, METH_O,
     "send_to_main_thread(signum) -> bool\n\nCalled on the main thread, once signal.signal() gave signum a "
     "Python handler: the signal, where it lands on another thread, is sent on to this one. False where "
     "there is nothing to send on (no Python handler, or the signal blocked on this thread)."},
    {"give_up_after", give_up_after, METH_VARARGS,
     "give_up_after(signum, message)\n\nsignum's action was the default: where its Python handler has not run "
     "5 s after it came (the main thread waits in native code), the process ends by it with the default "
     "action, as without xsp, after writing message (bytes) to stderr. message None: no longer."},
    {"handled", mark_handled, METH_NOARGS,
     "handled()\n\nCalled by the Python handler of the signals sent on: it ran, so the main thread needs no "
     "more waking for the stopping signals that came so far."},
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
