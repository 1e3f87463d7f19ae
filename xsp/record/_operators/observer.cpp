// The operator level's recorder: a RecordFunction observer that PyTorch calls around every aten
// operator, autograd node and user annotation, writing one small record per call into a buffer
// of the thread that ran it (xsp/record/operator_observer.py builds this file against the
// installed PyTorch's headers and loads it; its C functions are the whole interface).
//
// A record is 48 bytes: the call's start and end on CLOCK_MONOTONIC (xsp's host clock), its
// thread's OS id, its name and its inputs' shapes and dtypes as numbers of interned texts, its
// autograd sequence number and the PyTorch thread id of the forward call a backward node
// differentiates. Nothing is made of them here: xsp takes the finished records a window at a
// time (xsp_ops_take, xsp_ops_copy) and turns them into spans elsewhere.

#include <ATen/record_function.h>
#include <c10/core/ScalarType.h>
#include <c10/util/typeid.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kAbiVersion = 5;
constexpr uint8_t kUser = 1;      // flags: a user annotation (record_function)
constexpr uint8_t kBackward = 2;  // flags: an autograd node's call

struct Record {
    int64_t start_ns;
    int64_t end_ns;
    int64_t sequence_nr;
    int64_t forward_thread;  // PyTorch's id of the forward call's thread (0: none)
    int32_t thread;          // OS thread id
    int32_t name;            // interned name
    int32_t signature;       // interned shapes and dtypes (-1: not recorded)
    int32_t flags;
};
static_assert(sizeof(Record) == 48, "the record layout xsp reads");

int64_t now_ns() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// interned texts: deques, so that a text's address never moves once handed out
std::mutex texts_lock;
std::deque<std::string> names;
std::unordered_map<std::string, int32_t> name_ids;
std::deque<std::string> shapes_texts;
std::deque<std::string> dtypes_texts;
std::unordered_map<uint64_t, int32_t> signature_ids;

int32_t intern_name(const char* text) {
    std::lock_guard<std::mutex> guard(texts_lock);
    std::string key(text ? text : "");
    auto found = name_ids.find(key);
    if (found != name_ids.end()) return found->second;
    int32_t id = static_cast<int32_t>(names.size());
    names.push_back(key);
    name_ids.emplace(std::move(key), id);
    return id;
}

struct ThreadBuffer {
    std::mutex lock;
    std::vector<Record> records;
    int32_t thread = 0;
    uint64_t torch_thread = 0;
    // the last name pointers this thread interned (an aten operator's name never moves)
    std::unordered_map<const char*, std::pair<int32_t, std::string>> names_seen;
    std::unordered_map<uint64_t, int32_t> signatures_seen;
};

std::mutex buffers_lock;
std::vector<std::shared_ptr<ThreadBuffer>> buffers;
std::atomic<bool> recording{false};
std::atomic<bool> record_shapes{true};
std::atomic<int64_t> kept{0};
std::atomic<int64_t> max_records{INT64_MAX};
std::atomic<int64_t> dropped{0};  // past max_records
std::atomic<int64_t> failed{0};   // a call whose record could not be made (an exception in here)
std::atomic<int64_t> recorded{0};  // records kept since the start, taken or not
at::CallbackHandle handle = 0;

thread_local std::shared_ptr<ThreadBuffer> local;

ThreadBuffer& buffer() {
    if (!local) {
        local = std::make_shared<ThreadBuffer>();
        local->thread = static_cast<int32_t>(syscall(SYS_gettid));
        local->torch_thread = at::RecordFunction::currentThreadId();
        std::lock_guard<std::mutex> guard(buffers_lock);
        buffers.push_back(local);
    }
    return *local;
}

int32_t name_of(ThreadBuffer& mine, const char* text) {
    auto found = mine.names_seen.find(text);
    if (found != mine.names_seen.end() && found->second.second == text) return found->second.first;
    int32_t id = intern_name(text);
    mine.names_seen[text] = {id, std::string(text ? text : "")};
    return id;
}

inline uint64_t mix(uint64_t hash, uint64_t value) {
    hash ^= value + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2);
    return hash * 0x100000001b3ULL;
}

// Whether a tensor's sizes are plain numbers. Under torch.compile, dynamo traces with fake tensors
// whose sizes may be symbols: reading them as numbers would make the compiler guard on (specialize)
// each one, and recompile for every new batch size. Those tensors, and nested ones, have their
// shape written empty, as PyTorch's profiler does.
bool concrete_sizes(const at::Tensor& tensor) {
    return !tensor.is_nested() && !tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// The inputs' shapes and dtypes as the profiler writes them: "[[2, 8], [8, 8], []]" and
// ["float", "float", "Scalar"] (a tensor's dtype as its TypeMeta names it).
int32_t signature_of(ThreadBuffer& mine, c10::ArrayRef<const c10::IValue> inputs) {
    uint64_t hash = 0xcbf29ce484222325ULL ^ inputs.size();
    for (const auto& input : inputs) {
        if (input.isTensor()) {
            const auto& tensor = input.toTensor();
            if (!tensor.defined()) {
                hash = mix(hash, 1);
                continue;
            }
            hash = mix(hash, 2 + static_cast<uint64_t>(tensor.scalar_type()));
            if (!concrete_sizes(tensor)) {
                hash = mix(hash, 5);
                continue;
            }
            auto sizes = tensor.sizes();
            hash = mix(hash, sizes.size());
            for (auto size : sizes) hash = mix(hash, static_cast<uint64_t>(size));
        } else if (input.isScalar()) {
            hash = mix(hash, 3);
        } else {
            hash = mix(hash, 4);
        }
    }
    auto found = mine.signatures_seen.find(hash);
    if (found != mine.signatures_seen.end()) return found->second;
    std::string shapes = "[", dtypes = "[";
    bool first = true;
    for (const auto& input : inputs) {
        if (!first) {
            shapes += ", ";
            dtypes += ", ";
        }
        first = false;
        std::string dims, dtype;
        if (input.isTensor() && input.toTensor().defined()) {
            const auto& tensor = input.toTensor();
            bool first_dim = true;
            for (auto size : concrete_sizes(tensor) ? tensor.sizes() : c10::IntArrayRef()) {
                if (!first_dim) dims += ", ";
                first_dim = false;
                dims += std::to_string(size);
            }
            dtype = std::string(c10::scalarTypeToTypeMeta(tensor.scalar_type()).name());
        } else if (input.isScalar()) {
            dtype = "Scalar";
        }
        shapes += "[" + dims + "]";
        dtypes += "\"";
        for (char c : dtype) {
            if (c == '"' || c == '\\') dtypes += '\\';
            dtypes += c;
        }
        dtypes += "\"";
    }
    shapes += "]";
    dtypes += "]";
    int32_t id;
    {
        std::lock_guard<std::mutex> guard(texts_lock);
        auto global = signature_ids.find(hash);
        if (global != signature_ids.end()) {
            id = global->second;
        } else {
            id = static_cast<int32_t>(shapes_texts.size());
            shapes_texts.push_back(std::move(shapes));
            dtypes_texts.push_back(std::move(dtypes));
            signature_ids.emplace(hash, id);
        }
    }
    mine.signatures_seen.emplace(hash, id);
    return id;
}

struct Started : at::ObserverContext {
    Record record;
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) try {
    if (!recording.load(std::memory_order_relaxed)) return nullptr;
    auto started = std::make_unique<Started>();
    ThreadBuffer& mine = buffer();
    Record& record = started->record;
    record.thread = mine.thread;
    record.name = name_of(mine, fn.name());
    record.signature = record_shapes.load(std::memory_order_relaxed) ? signature_of(mine, fn.inputs()) : -1;
    record.sequence_nr = fn.seqNr();
    record.forward_thread = static_cast<int64_t>(fn.forwardThreadId());
    auto scope = fn.scope();
    record.flags = (scope == at::RecordScope::USER_SCOPE ? kUser : 0)
                   | (scope == at::RecordScope::BACKWARD_FUNCTION ? kBackward : 0);
    record.start_ns = now_ns();
    return started;
} catch (...) {  // never into PyTorch: a call not recorded is counted
    failed.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext* context) try {
    int64_t end = now_ns();
    if (context == nullptr) return;
    auto* started = static_cast<Started*>(context);
    started->record.end_ns = end;
    if (kept.fetch_add(1, std::memory_order_relaxed) >= max_records.load(std::memory_order_relaxed)) {
        kept.fetch_sub(1, std::memory_order_relaxed);
        dropped.fetch_add(1, std::memory_order_relaxed);
        return;
    }
    ThreadBuffer& mine = buffer();  // the thread that ends it (an async call's end: its own thread's)
    std::lock_guard<std::mutex> guard(mine.lock);
    mine.records.push_back(started->record);
    recorded.fetch_add(1, std::memory_order_relaxed);
} catch (...) {
    failed.fetch_add(1, std::memory_order_relaxed);
}

std::mutex take_lock;
std::vector<Record> taken;

}  // namespace

extern "C" {

int xsp_ops_abi_version() { return kAbiVersion; }

int64_t xsp_ops_now_ns() { return now_ns(); }

// Start recording (once per process at a time): 0, or -1 when a recording runs already.
int xsp_ops_start(int shapes, int64_t most_records) {
    if (recording.load()) return -1;
    record_shapes.store(shapes != 0);
    max_records.store(most_records > 0 ? most_records : INT64_MAX);
    kept.store(0);
    dropped.store(0);
    failed.store(0);
    recorded.store(0);
    if (handle == 0) {
        auto callback = at::RecordFunctionCallback(on_start, on_end)
                            .needsInputs(shapes != 0)
                            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                                     at::RecordScope::USER_SCOPE, at::RecordScope::TORCHSCRIPT_FUNCTION});
        handle = at::addGlobalCallback(callback);
    }
    recording.store(true);
    return 0;
}

// Stop recording; the records kept stay to be taken.
void xsp_ops_stop() {
    recording.store(false);
    if (handle != 0) {
        at::removeCallback(handle);
        handle = 0;
    }
}

int64_t xsp_ops_dropped() { return dropped.exchange(0); }

int64_t xsp_ops_failed() { return failed.exchange(0); }

// Pause (1) or resume (0) the calling thread's RecordFunction callbacks: an always-on session's
// step recorded without operators runs its model call paused, so that its operators cost what
// they cost without xsp (no inputs boxed for the callback, no record made and dropped later).
// Only what this function paused is resumed: a thread whose RecordFunction someone else turned
// off stays off. Returns 1 when the call changed the thread's state.
int xsp_ops_pause_thread(int pause) {
    thread_local bool paused_here = false;
    if (pause) {
        if (paused_here || !at::isRecordFunctionEnabled()) return 0;
        at::enableRecordFunction(false);
        paused_here = true;
        return 1;
    }
    if (!paused_here) return 0;
    at::enableRecordFunction(true);
    paused_here = false;
    return 1;
}

// Records kept since the start (a session's windows are sized by them too).
int64_t xsp_ops_recorded() { return recorded.load(std::memory_order_relaxed); }

// Move the finished records that belong to the window ending at `cut_ns` aside (xsp_ops_copy
// hands them out): those that ended by `cut_ns`; of any thread, never one that started at or after
// `held_since_ns` (what the held threads still have open may hold it), and of each thread `held[i]`,
// none that started at or after `held_from[i]` (where its open step began: the window took the
// thread's steps before it). A negative cut takes everything. Returns how many were moved aside.
int64_t xsp_ops_take(int64_t cut_ns, int64_t held_since_ns, const int32_t* held, const int64_t* held_from,
                     int64_t held_count) {
    std::lock_guard<std::mutex> take_guard(take_lock);
    taken.clear();
    std::vector<std::shared_ptr<ThreadBuffer>> all;
    {
        std::lock_guard<std::mutex> guard(buffers_lock);
        all = buffers;
    }
    for (auto& each : all) {
        int64_t since_ns = held_since_ns;
        for (int64_t i = 0; i < held_count; ++i)
            if (held[i] == each->thread && held_from[i] < since_ns) since_ns = held_from[i];
        std::lock_guard<std::mutex> guard(each->lock);
        if (cut_ns < 0) {
            taken.insert(taken.end(), each->records.begin(), each->records.end());
            each->records.clear();
            continue;
        }
        std::vector<Record> left;
        for (const auto& record : each->records) {
            if (record.end_ns <= cut_ns && record.start_ns < since_ns) {
                taken.push_back(record);
            } else {
                left.push_back(record);
            }
        }
        each->records.swap(left);
    }
    all.clear();
    {  // the buffers of threads that have ended and left nothing: no later window visits them
        std::lock_guard<std::mutex> guard(buffers_lock);
        for (size_t i = buffers.size(); i-- > 0;) {
            bool empty;
            {
                std::lock_guard<std::mutex> records_guard(buffers[i]->lock);
                empty = buffers[i]->records.empty();
            }
            // only this list holds it: its thread (whose thread_local held the other) has ended
            if (empty && buffers[i].use_count() == 1) buffers.erase(buffers.begin() + static_cast<long>(i));
        }
    }
    kept.fetch_sub(static_cast<int64_t>(taken.size()));
    return static_cast<int64_t>(taken.size());
}

// Copy the records xsp_ops_take moved aside into `out` (room for that many) and let them go.
void xsp_ops_copy(Record* out) {
    std::lock_guard<std::mutex> take_guard(take_lock);
    if (!taken.empty()) std::memcpy(out, taken.data(), taken.size() * sizeof(Record));
    taken.clear();
    taken.shrink_to_fit();
}

int32_t xsp_ops_name_count() {
    std::lock_guard<std::mutex> guard(texts_lock);
    return static_cast<int32_t>(names.size());
}

const char* xsp_ops_name(int32_t id) {
    std::lock_guard<std::mutex> guard(texts_lock);
    return id >= 0 && static_cast<size_t>(id) < names.size() ? names[id].c_str() : nullptr;
}

int32_t xsp_ops_signature_count() {
    std::lock_guard<std::mutex> guard(texts_lock);
    return static_cast<int32_t>(shapes_texts.size());
}

const char* xsp_ops_shapes(int32_t id) {
    std::lock_guard<std::mutex> guard(texts_lock);
    return id >= 0 && static_cast<size_t>(id) < shapes_texts.size() ? shapes_texts[id].c_str() : nullptr;
}

const char* xsp_ops_dtypes(int32_t id) {
    std::lock_guard<std::mutex> guard(texts_lock);
    return id >= 0 && static_cast<size_t>(id) < dtypes_texts.size() ? dtypes_texts[id].c_str() : nullptr;
}

// The threads that recorded: their OS id and PyTorch's id of them (a backward record's
// forward_thread is PyTorch's id). Returns how many; fills at most `room` pairs.
int64_t xsp_ops_threads(int32_t* os_ids, uint64_t* torch_ids, int64_t room) {
    std::lock_guard<std::mutex> guard(buffers_lock);
    int64_t count = static_cast<int64_t>(buffers.size());
    for (int64_t i = 0; i < count && i < room; ++i) {
        os_ids[i] = buffers[i]->thread;
        torch_ids[i] = buffers[i]->torch_thread;
    }
    return count;
}

}  // extern "C"
