"""Automatic steps: one step per iteration of the user's loop, decided while the loop runs.

Users never call xsp in their loop, yet every latency, throughput and share is counted per
step, so a step must be what they think of as one iteration:

* **training** (a model called while autograd records a graph, then a backward pass or an
  optimizer step; without them the step is an inference step all the same): the step ends when
  ``optimizer.step()`` returns, and the next one begins right there, so the input wait,
  ``zero_grad``, forward, loss, backward and the optimizer all fall inside one step. Several
  optimizers in one iteration (a GAN) end one step: the step closes at the last optimizer
  step before the leading model is called again (or an input wait, an evaluation call, a
  ``generate()``, the same optimizer stepping again, or the session's end). Gradient
  accumulation (several forwards and backwards, then one ``optimizer.step()``) is one step from
  the first iteration on: until an optimizer has stepped, the leading model's next training call
  after a backward (or the next input wait) only marks where a step *would* end; the first
  optimizer step makes them one step, and without any (at the session's end, at a ``zero_grad()``
  that throws their gradients away, or after :data:`MAX_TENTATIVE` of them) each becomes a step
  of its own. A closure optimizer
  (``optimizer.step(closure)``, LBFGS) is one step per ``step()``: the model calls of its closure
  are inside it and decide nothing.
* **inference**: the first model called leads. Each of its calls starts a step; other models
  called before its next call (a head after its encoder) join that step (in an always-on
  session, only under the same request's trace: a call under another request's span begins a
  step of its own), and an input wait
  (a DataLoader's ``next()``) before the leading call belongs to its step. A model called
  :data:`HANDOVER_CALLS` times without the leader (a second loop over another model, the
  quantized one after the float one) leads from its first of those calls on.
* a module first called from PyTorch's set-up code (quantization's observers, ``torch.export``,
  ONNX export) is no model: its calls are not recorded until the user's code calls it.
* **generate()** (Hugging Face): one step per call; the model calls inside are its children.
* a model called **without autograd before the model trained** in each iteration (a frozen
  teacher in distillation, a frozen encoder, a target network) is part of that iteration's
  training step: its call, the first of the thread or the first after a training step, is
  joined by the training call of another model that follows it.
* inside ``xsp.step()`` nothing automatic happens: the user's step is the step.

A step that is one model call and nothing else is that call's own ``predict`` span (the step
root, as XSP's model level has it); any other step is a ``step`` span (``train_step``,
``inference_step``, ``<model>.generate``) that covers its pieces.

Only model-level events reach this module (a top-level model call, an input wait, an optimizer
step, a backward pass, ``generate()``): a handful per iteration, never one per layer. A step
is decided when the next one begins, so each thread keeps the records of its unfinished step
until then (:attr:`AutoSteps.holding`), and windows never separate them from their step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Final, Protocol

from xsp.core.schema import ATTR_GENERATE_SAMPLES, ATTR_STEP_TYPE
from xsp.record.marks import MarkKind
from xsp.record.sampling import note_as_before


class StepListeners(Protocol):
    """What the steps of a thread tell when one is decided (:class:`xsp.record.recording.Recording`)."""

    @property
    def long_step_ns(self) -> int: ...
    @property
    def report_after_ns(self) -> int: ...
    @property
    def on_long_step(self) -> Callable[[int], None] | None: ...
    @property
    def on_ended_thread_step(self) -> Callable[[Any, int], None] | None: ...
    @property
    def sampler(self) -> Any: ...


class StepsThread(Protocol):
    """The thread whose steps :class:`AutoSteps` decides (:class:`xsp.record.recording.ThreadBuffer`)."""

    depth: int
    open_steps: int
    marks: list[Any]
    optimizer_starts: Any

    @property
    def recording(self) -> StepListeners: ...


class StepType(enum.IntEnum):
    NONE = 0
    INFERENCE = 1
    TRAIN = 2
    GENERATE = 3


_NONE, _INFERENCE, _TRAIN, _GENERATE = StepType.NONE, StepType.INFERENCE, StepType.TRAIN, StepType.GENERATE
MAX_TENTATIVE: Final = 64
"""Boundaries a training loop with no optimizer step yet may leave open before they are steps."""
HANDOVER_CALLS: Final = 3
"""Calls of another model, without the leading one, after which it leads."""
TRAIN_STEP_NAME: Final = "train_step"
INFERENCE_STEP_NAME: Final = "inference_step"
GENERATE_SUFFIX: Final = ".generate"
_ATTRIBUTES: Final[dict[StepType, dict[str, Any]]] = {
    _INFERENCE: {ATTR_STEP_TYPE: "inference"},
    _TRAIN: {ATTR_STEP_TYPE: "train"},
    _GENERATE: {ATTR_STEP_TYPE: "generate"},
}


def hotpath_constants() -> tuple[Any, ...]:
    """What xsp's C wrapper (``xsp/record/_hotpath/``) needs to decide steps as
    :meth:`AutoSteps.call_begins` does: the step types it compares and writes, and the name and
    attributes of a finished training or inference step's record."""
    return (_NONE, _INFERENCE, _TRAIN, MarkKind.STEP, TRAIN_STEP_NAME, _ATTRIBUTES[_TRAIN], INFERENCE_STEP_NAME,
            _ATTRIBUTES[_INFERENCE])


class AutoSteps:
    """The step state of one thread, driven by that thread's model-level events."""

    __slots__ = ("_buffer", "type", "start_ns", "last_end_ns", "closed_ns", "leader", "pieces",
                 "trained", "wait_ns", "resume_ns", "nested", "name", "optimizer_seen", "lane", "lane_grad",
                 "closed_by", "tentative", "joiner", "joined", "python_decides", "waited", "samples", "frozen")

    def __init__(self, buffer: StepsThread) -> None:
        self._buffer = buffer
        self.optimizer_seen = False
        """An optimizer step has run on this thread: training steps end only at optimizer steps."""
        self.wait_ns = 0
        """Start of an input wait seen while no step was open: the next step starts there."""
        self.resume_ns = 0
        """Where the last training step ended: the next training step starts there."""
        self._reset()

    def _reset(self) -> None:
        self.lane = 0
        """``id`` of the model whose next top-level call may take the lane (0: none): the open
        step is that model's one call and nothing else, so its next call (with autograd as
        :attr:`lane_grad` says) only decides the step before and opens the next, the same
        way. The model-level wrapper does that inline; every other event closes the lane, and
        :meth:`call_begins` opens it again when the state allows. (xsp's C wrapper decides every
        case of :meth:`call_begins` outside ``xsp.step()`` and ``generate()`` itself, from these
        slots; see :func:`hotpath_constants`.)"""
        self.lane_grad = False
        self.type = _NONE
        self.start_ns = self.last_end_ns = self.closed_ns = 0
        self.leader: int | None = None
        self.pieces = self.nested = 0
        self.trained = False
        """A backward pass or an optimizer step ran in the step: it is a training step."""
        self.name = ""
        self.closed_by = 0
        """``id`` of the optimizer whose step closed the step (its next step begins the next one)."""
        self.tentative: list[tuple[int, int]] = []
        """``(end of the iteration, start of the next)`` where the open training step would end if
        no optimizer step came (gradient accumulation, or a loop without an optimizer)."""
        self.joiner = 0
        """``id`` of the model other than the leader whose calls joined the open inference step
        since the leader's call, one after another (a head after its encoder: one call)."""
        self.joined: list[tuple[int, int]] = []
        """Those calls: ``(the call's start, the step's last end before it)``."""
        self.python_decides = False
        """The step's state is more than xsp's C wrapper reads (tentative ends):
        Python decides the next top-level call's step."""
        self.waited = False
        """The last tentative end was an input wait, and the leading model has not been called
        since: its next call is the forward of the micro-batch that wait fetched, not a new
        iteration."""
        self.samples: int | None = None
        """An open ``generate()`` step's input sequences (its first argument's first dimension)."""
        self.frozen: tuple[int, int] | None = None
        """``(the open step's start, where its iteration began)`` while the open inference step is
        one call without autograd that may begin a training iteration (a frozen teacher or
        encoder called before the model trained on its output): the iteration's first, or the
        first after a training step was decided. A training call of another model makes it that
        iteration's training step (see :meth:`call_begins`)."""

    @property
    def holding(self) -> bool:
        """True while this thread has records that belong to a step not yet decided (an open
        one, or the training step that begins where the last one ended, decided as its
        iteration's work had begun)."""
        return self.type is not _NONE or self.wait_ns != 0 or self.resume_ns != 0

    def _other_request(self) -> bool:
        """Another model's call is under another request's span than the open step (an
        always-on session's, which joins each step to its request's trace): it begins a step of
        its own, in its own request's trace, instead of joining the step of the request before
        (two endpoints' models on one worker thread, or asyncio tasks taking turns)."""
        sampler = self._buffer.recording.sampler
        return sampler is not None and bool(sampler.other_request(self._buffer))

    def _suspended(self) -> bool:
        return bool(self._buffer.open_steps or self.nested or self._buffer.depth)

    # events --------------------------------------------------------------------------
    def lane_call(self, start_ns: int) -> bool:
        """The lane's model calls again, with autograd as before (see :attr:`lane`): when the
        step before is not worth telling (not long, nothing to report), that call only ends it
        and opens the next, and True is returned; False leaves the call to :meth:`call_begins`.
        (The C wrapper does the same in ``plan_call``.)"""
        recording = self._buffer.recording
        before = self.last_end_ns
        if before - self.start_ns < recording.long_step_ns and before < recording.report_after_ns:
            self.start_ns = start_ns
            return True
        return False

    def call_begins(self, module_id: int, start_ns: int, training: bool) -> bool:
        """A top-level model call starts; ``training``: autograd is recording a graph.

        Returns True when deciding the step before it handed its records over (the call's
        start is worth reading again).
        """
        self.lane = 0
        if self._buffer.open_steps or self.nested or self._buffer.optimizer_starts:
            return False  # inside xsp.step(), generate(), or an optimizer's closure: its step decides
        kind = self.type
        if kind is _INFERENCE and self.pieces == 1 and module_id == self.leader and not training:
            # the most common case by far, one model per iteration: the last step was its one
            # call (no step span), and this call is the next one
            self.type = _NONE  # decided: the thread's records can be handed over
            handed_over = self._decided(self.start_ns, self.last_end_ns)
            self.type, self.start_ns = _INFERENCE, start_ns
            self.lane, self.lane_grad = module_id, False
            return handed_over
        if (kind is _TRAIN and self.pieces == 1 and module_id == self.leader and training and not self.trained
                and not self.closed_ns and not self.optimizer_seen and not self.wait_ns):
            # as common: a forward with autograd on and no training (an evaluation without
            # no_grad), one call per step; what _finish and _open would do, in short
            self.type = _NONE
            handed_over = self._decided(self.start_ns, self.last_end_ns)
            self.type, self.start_ns = _TRAIN, start_ns
            self.lane, self.lane_grad = module_id, True
            return handed_over
        decided = False
        frozen_after = 0
        if kind is not _NONE and module_id != self.leader and self._other_request():
            # another model's call under another request's span: a step of its own, in its own
            # request's trace, whatever the open step is (a model called with autograd on is no
            # frozen model's trainee, nor one step's other model, across requests)
            decided = self._finish_training() if kind is _TRAIN and self.closed_ns else self._finish(self.last_end_ns)
        elif kind is _TRAIN:
            leads = module_id == self.leader or self.leader is None
            if self.closed_ns and (not training or leads):  # the next iteration, or an evaluation
                if not training and not leads:  # another model's: perhaps the next iteration's frozen one
                    frozen_after = self.closed_ns
                decided = self._finish_training()
            elif training and leads and not self.optimizer_seen:
                if self.trained:  # after a backward: the next micro-batch, or the next iteration
                    return self._tentative_end(start_ns)
                if not self.waited:  # (after an input wait that began the next micro-batch: its forward)
                    decided = self._finish(self.last_end_ns)
            elif leads and not self.optimizer_seen:
                # an evaluation call of a loop with no optimizer (input gradients: attacks,
                # saliency): the iterations before it were steps, and it is one of its own
                decided = self._finish(self.last_end_ns)
            if leads and self.waited:
                self.waited, self.python_decides = False, bool(self.tentative)
        elif kind is _INFERENCE and training and module_id != self.leader and self._frozen_iteration():
            # the frozen model's call began this iteration: the model trained on its output
            # leads the iteration's training step, from where the iteration began
            began = self.frozen[1] if self.frozen is not None else self.start_ns
            self.type, self.leader, self.start_ns = _TRAIN, module_id, min(self.start_ns, began)
            self.frozen, self.python_decides = None, bool(self.tentative)
            self.pieces += 1
            return False
        elif kind is _INFERENCE and (training or module_id == self.leader or self._other_request()):
            decided = self._finish(self.last_end_ns)
        elif kind is _INFERENCE:
            joined = self._joins(module_id, start_ns)
            if joined is not None:
                return joined
        if self.type is _NONE:
            self._open(_TRAIN if training else _INFERENCE, start_ns, module_id)
            if frozen_after:  # its next call is Python's to decide (xsp's C wrapper hands it over)
                self.frozen, self.python_decides = (self.start_ns, min(self.start_ns, frozen_after)), True
            elif self.pieces == 1 and (not training or not self.optimizer_seen):
                self.lane, self.lane_grad = module_id, training
        else:
            self.pieces += 1
        return decided

    def _frozen_iteration(self) -> bool:
        """The open inference step is one call without autograd that began an iteration: the
        first after a training step (:attr:`frozen`), or, before any optimizer step, any such
        step of one call (the first iteration's; xsp's C wrapper hands a training call of another
        model over then), but none another call joined."""
        if self.joined or self.pieces > 2:  # (2: the call and the input wait before it)
            return False
        if self.frozen is not None:
            return self.frozen[0] == self.start_ns
        return not self.optimizer_seen

    def call_ends(self, end_ns: int) -> None:
        if end_ns > self.last_end_ns and self.type is not _NONE and not self.nested and not self._buffer.open_steps:
            self.last_end_ns = end_ns

    def wait_begins(self, start_ns: int) -> None:
        """An input wait (a DataLoader's ``next()``) starts."""
        self.lane = 0
        if self._suspended():
            return
        if self.type is _INFERENCE:
            self._finish(self.last_end_ns)
        elif self.type is _TRAIN:
            if self.closed_ns:
                self._finish_training()
            elif not self.optimizer_seen:
                if self.trained:  # the wait begins the next micro-batch, or the next iteration
                    self._tentative_end(start_ns)
                    self.waited = self.python_decides = True  # (Python decides the call that follows)
                    return
                if self.waited:  # another wait of that micro-batch (two loaders zipped)
                    return
                self._finish(self.last_end_ns)
        if self.type is _NONE and not self.wait_ns:
            self.wait_ns = start_ns

    def forget_wait(self, start_ns: int) -> None:
        """The wait that began at ``start_ns`` ended the loop (StopIteration): it begins no step."""
        if self.wait_ns == start_ns:
            self.wait_ns = 0

    def piece_ends(self, end_ns: int, trains: bool = False, start_ns: int = 0) -> None:
        """An input wait (or, with ``trains``, a backward pass from ``start_ns``) of the open step
        ended. A backward pass with no step open begins a training step: its model ran where no
        call of it is seen (a compiled training function, raw tensors), and its iteration's step
        would otherwise begin at the optimizer step."""
        self.lane = 0
        if (trains and start_ns and self.type is _NONE and not self._suspended()
                and not self._buffer.optimizer_starts):
            self._open(_TRAIN, start_ns, None)
        if self.type is not _NONE and not self._suspended():
            self.pieces += 1
            self.trained |= trains
            self.last_end_ns = max(self.last_end_ns, end_ns)

    def optimizer_begins(self, optimizer_id: int) -> None:
        """An optimizer step begins: the same optimizer stepping again begins the next iteration
        (a closure optimizer's loop has no model call between its steps)."""
        self.lane = 0
        if (self.type is _TRAIN and self.closed_ns and self.closed_by == optimizer_id
                and not self._buffer.open_steps and not self.nested and not self._buffer.depth):
            self._finish_training()

    def optimizer_ends(self, start_ns: int, end_ns: int, optimizer_id: int = 0) -> None:
        self.lane = 0
        self.optimizer_seen = True
        if self._suspended():
            return
        if self.type is _NONE:  # no model call was seen in this iteration
            self._open(_TRAIN, start_ns, None)
        self.type = _TRAIN  # an optimizer after a no-grad call makes it training all the same
        self.trained = True
        self.closed_ns = end_ns
        self.closed_by = optimizer_id
        self.pieces += 1
        self.last_end_ns = max(self.last_end_ns, end_ns)
        if self.tentative:  # the iterations before it were micro-batches of one step
            self.tentative = []
            self.python_decides = self.waited = False

    def gradients_cleared(self) -> None:
        """``zero_grad()``: the gradients so far are thrown away, so an open training iteration
        that no optimizer step closed (a warm-up forward and backward) was a step of its own, and
        ends here; so does each iteration left tentative before it."""
        self.lane = 0
        if (self.type is not _TRAIN or self.closed_ns or not (self.trained or self.tentative)
                or self._suspended() or self._buffer.optimizer_starts):
            return
        self._finish(self.last_end_ns)

    def generate_begins(self, name: str, start_ns: int, samples: int | None = None) -> None:
        """A ``generate()`` call of model ``name`` begins, on ``samples`` input sequences (its
        model calls run on more where it searches beams, or fewer: an encoder-decoder's)."""
        self.lane = 0
        if self._buffer.open_steps:
            return
        if self.nested:
            self.nested += 1
            return
        waited_ns = self.wait_ns  # an input wait just before generate() is part of its step
        self.finish()
        self.wait_ns = waited_ns
        self._open(_GENERATE, start_ns, None)
        self.name = name + GENERATE_SUFFIX
        self.nested = 1
        self.samples = samples

    def generate_ends(self, end_ns: int) -> None:
        self.lane = 0
        if self._buffer.open_steps or not self.nested:
            return
        self.nested -= 1
        if not self.nested:
            self._finish(end_ns)

    def finish(self, now_ns: int = 0, *, thread_ended: bool = False) -> None:
        """Decide the open step now (an explicit step begins, a generate() call, the session ends).

        ``thread_ended``: the thread has ended, and another thread decides its last step (its
        windows): only ``recording.on_ended_thread_step`` hears of it, since the listeners of
        ``on_long_step`` work on the thread whose step ended.
        """
        self.lane = 0
        if self.type is _TRAIN:
            self._finish(self.closed_ns or self.last_end_ns, thread_ended)
        elif self.type is _INFERENCE:
            self._finish(self.last_end_ns, thread_ended)
        elif self.type is _GENERATE:
            self.nested = 0
            self._finish(max(now_ns, self.last_end_ns), thread_ended)
        self._reset()
        self.wait_ns = self.resume_ns = 0

    def decided_elsewhere(self, start_ns: int, end_ns: int) -> None:
        """Another thread decided this thread's open step (:meth:`Recording.decide_quiet_steps
        <xsp.record.recording.Recording.decide_quiet_steps>`): tell whoever listens, as its next
        call would have."""
        self._decided(start_ns, end_ns)

    # ---------------------------------------------------------------------------------
    def _open(self, kind: StepType, start_ns: int, leader: int | None) -> None:
        waited, resumed = self.wait_ns, (self.resume_ns if kind is _TRAIN else 0)
        if waited or resumed:
            start_ns = min(waited, resumed) if waited and resumed else (waited or resumed)
        self.type = kind
        self.start_ns = start_ns
        self.leader = leader
        self.pieces = 2 if waited else 1
        self.wait_ns = self.resume_ns = 0

    def _finish_training(self) -> bool:
        return self._finish(self.closed_ns, resumes=True)

    def _tentative_end(self, start_ns: int) -> bool:
        """The open training step would end here if no optimizer step came; past
        :data:`MAX_TENTATIVE` of them, it is decided that none will (they become steps)."""
        self.tentative.append((self.last_end_ns, start_ns))
        self.pieces += 1
        self.trained = False  # of the iteration this call begins: its backward has yet to come
        self.python_decides = True
        return self._split_tentative() if len(self.tentative) >= MAX_TENTATIVE else False

    def _split_tentative(self) -> bool:
        """Every tentative end becomes a step end (no optimizer step made them one step); the
        last iteration stays open."""
        told = False
        start_ns = self.start_ns
        for end_ns, next_start_ns in self.tentative:
            self._buffer.marks.append((MarkKind.STEP, start_ns, max(end_ns, start_ns), TRAIN_STEP_NAME,
                                       _ATTRIBUTES[_TRAIN], None))
            told = self._decided(start_ns, end_ns) or told
            start_ns = next_start_ns
        self.start_ns = start_ns
        self.tentative = []
        self.pieces = 2 if self.trained else 1  # the open iteration: its call, and its backward if it came
        self.python_decides = False
        return told

    def _joins(self, module_id: int, start_ns: int) -> bool | None:
        """Another model's call joins the open inference step; its :data:`HANDOVER_CALLS`-th call
        without the leader makes it lead (its earlier calls were steps of its own). None when it
        only joined."""
        if self.joiner != module_id:
            self.joiner, self.joined = module_id, []
        calls = self.joined
        calls.append((start_ns, self.last_end_ns))
        if len(calls) < HANDOVER_CALLS:
            return None
        self.pieces = max(1, self.pieces - (len(calls) - 1))  # the leader's step, without this model's calls
        told = self._finish(calls[0][1])
        sampler = self._buffer.recording.sampler
        for (first, _), (_, end_ns) in zip(calls, calls[1:]):  # one step per earlier call, no step span
            if sampler is not None:  # recorded as the step they joined was decided
                note_as_before(sampler, self._buffer, first)
            told = self._decided(first, end_ns) or told
        self._open(_INFERENCE, start_ns, module_id)
        return told

    def _finish(self, end_ns: int, thread_ended: bool = False, resumes: bool = False) -> bool:
        """Decide the open step as ending at ``end_ns``; ``resumes``: the next (training) step
        begins there, and what the thread recorded since is that step's (a window taken as the
        decided step is told of leaves it with the thread, see :attr:`holding`)."""
        if self.tentative and not self.closed_ns:  # no optimizer step: each iteration was a step
            self._split_tentative()
        kind, start_ns = self.type, self.start_ns
        buffer = self._buffer
        if kind is not _GENERATE:  # a model called with autograd on, but never trained
            kind = _TRAIN if self.trained else _INFERENCE
        if kind is not _INFERENCE or self.pieces > 1:
            name = self.name or (TRAIN_STEP_NAME if kind is _TRAIN else INFERENCE_STEP_NAME)
            attributes = _ATTRIBUTES[kind]
            if kind is _GENERATE and self.samples is not None:
                attributes = {**attributes, ATTR_GENERATE_SAMPLES: self.samples}
            buffer.marks.append((MarkKind.STEP, start_ns, max(end_ns, start_ns), name, attributes, None))
        self._reset()
        self.resume_ns = end_ns if resumes else 0
        if thread_ended:
            listener = buffer.recording.on_ended_thread_step
            if listener is not None:
                listener(buffer, end_ns - start_ns)
            return False
        return self._decided(start_ns, end_ns)

    def _decided(self, start_ns: int, end_ns: int) -> bool:
        """A step of this thread is decided: tell whoever listens (long-step export, flushes).
        True when someone was told."""
        recording = self._buffer.recording
        if recording.on_long_step is not None and (end_ns - start_ns >= recording.long_step_ns
                                                   or end_ns >= recording.report_after_ns):
            recording.on_long_step(end_ns - start_ns)  # (an always-on session's sampler hears it there)
            return True
        sampler = recording.sampler
        if sampler is not None:  # it learns what a slow step is from every step (xsp's C wrapper tells it its own)
            sampler.step_ended(end_ns - start_ns, self._buffer)
        return False
