"""The columns of key samples and of a comparison, and the verdicts, tests and changes a
comparison reports."""

from __future__ import annotations

import enum
import re
from typing import Final

from xsp.core import schema as col


class KeyBy(str, enum.Enum):
    """How spans of two runs are matched."""

    PATH = "path"
    """By ``path``: one key per place in the model (``predict[0]/layer1.0.conv1[0]``)."""
    NAME = "name"
    """By level and name: every ``aten::conv2d`` together."""
    LINE = "line"
    """By the line of the user's code that made the calls (``train.py:42 Net.forward``): each
    line's outermost spans, so a change is attributed to the line whose calls it slowed."""


class Verdict(str, enum.Enum):
    """What happened to a key (and, for the first three and the last two, to the whole run)."""

    REGRESSED = "regressed"
    IMPROVED = "improved"
    UNCHANGED = "unchanged"
    ADDED = "added"
    REMOVED = "removed"
    INCONCLUSIVE = "inconclusive"
    """The whole run only: nothing regressed, but a change of the threshold at a top-level key
    (a model call, a step) could not have been detected (too few steps, too noisy a machine,
    processes too far apart): no evidence either way."""
    NO_VERDICT = "no verdict"
    """The whole run only: no key could be judged (the runs share none, or have too few steps a
    side): nothing was compared (:meth:`xsp.gate.diff.Diff.nothing_judged` says why)."""


class Judged(str, enum.Enum):
    """How the new run's times were judged (``settings["judged"]`` of a diff)."""

    COMMON_SHIFT = "against the common shift"
    CPU_WAITS = "for the threads' waits for a CPU"
    MACHINE_SPEED = "at equal machine speed"
    RAW = "raw times"


WAITED_NOTE: Final = "changed by less than"
"""How the note of a key left unjudged for its run's waits for a CPU starts."""
WITH_RUN_NOTE: Final = "moved with the whole run"
"""How the note of a key left unjudged for moving with its whole run starts."""
ONE_SAMPLE_NOTE: Final = "one sample on a side: no verdict"
BELOW_UNCHANGED_NOTE: Final = "not judged: the key above it did not change"
"""The note of a key whose family was not tested (hierarchical testing: its parent did not change)."""
NOT_SIGNIFICANT_NOTE: Final = "moved past the threshold, but not significantly"
"""The note of a key whose median moved by more than the threshold without its test showing it
(too few steps or too noisy a side): no evidence either way, never ``unchanged``."""
WITHIN_SCATTER_NOTE: Final = "moved past the threshold, by less than the keys of two runs scatter"
"""The note of a key of one run a side whose move passed the threshold but not how far the keys
of two processes of one program sit apart (the scatter floor): not judged either way."""
UNJUDGED_NOTES: Final = (WAITED_NOTE, WITH_RUN_NOTE, ONE_SAMPLE_NOTE, BELOW_UNCHANGED_NOTE, NOT_SIGNIFICANT_NOTE,
                         WITHIN_SCATTER_NOTE)
"""The notes of keys that are ``unchanged`` because they were not judged (reports show them so)."""


class Test(str, enum.Enum):
    """The statistic behind a key's verdict."""

    RANK = "mann-whitney"
    """Mann-Whitney U on the per-step samples, with hierarchical false-discovery control (the
    keys below a key are tested only when it changed)."""
    RUNS = "runs"
    """Several runs on each side but too few steps for a rank test (a span outside steps, one
    per run): the between-run t test on the runs' values alone."""
    RANK_AND_RUNS = "mann-whitney+runs"
    """Several runs on each side: the rank test on the pooled steps *and* a t test on the runs'
    medians (their logarithms, the variance moderated across keys) must both reject; the
    larger p-value is the key's."""
    INTERVAL = "leveled-interval"
    """Leveled traces: one figure a side, each with its 95% interval (``duration_ci_ns``): a z
    test on the difference, its standard error from the two intervals, Benjamini-Hochberg over
    all keys tested."""
    OVERLAP = "interval-overlap"
    """Too few samples for a rank test: the two sides' ranges must not overlap."""
    NONE = "none"
    """One sample on a side: noise cannot be told from change, so no verdict is given."""


MIN_RANK_SAMPLES: Final = 5
"""Samples each side needs for the rank test (with 5 and 5, its smallest p is 0.008)."""
MIN_OVERLAP_SAMPLES: Final = 2
"""Samples each side needs for the interval-overlap fallback."""
MIN_RUNS: Final = 2
"""Runs each side needs (a key present in each) for the between-run test."""

# columns of a key-samples frame (one row per key of one run)
KEY: Final = "key"
PARENT_KEY: Final = "parent_key"
COUNT: Final = "count"
TOTAL_NS: Final = "total_ns"
SAMPLES_NS: Final = "samples_ns"
"""Sorted per-step durations (an int64 array per key)."""
SAMPLE_COUNT: Final = "sample_count"
"""Steps (or lone spans) the samples came from; more than ``len(samples_ns)`` in a summary
that kept quantiles only."""
KERNELS_PER_STEP: Final = "kernels_per_step"
"""Median count of kernel-level spans under a layer per step (NaN: no kernels recorded)."""
INPUT_DTYPES: Final = "input_dtypes"
"""The dtypes of a key's tensor inputs, as text (from the operator level: xsp's ``input_dtypes``
attribute, a Kineto trace's ``Input type``), or None."""
DTYPE_ATTRIBUTES: Final = ("input_dtypes", "Input type")
"""Attribute keys that hold an operator's input dtypes, in xsp's traces and in Kineto's."""
DTYPE_PATTERN: Final = "|".join(re.escape(name) for name in DTYPE_ATTRIBUTES)
CI_NS: Final = "ci_ns"
"""Of a leveled trace's key (one figure per key): the half-width of the 95% interval of that
figure, from its spans' ``duration_ci_ns`` (NaN elsewhere, and for a key with several steps)."""
STEP_CV: Final = "step_cv"
"""Of a summary's key: the coefficient of variation of every per-step sample it had, taken before
only quantiles of them were kept (which leave out the tails: a run and its own summary told two
figures). NaN elsewhere: a trace's samples are all there."""
OPTIONAL_KEY_COLUMNS: Final = (CI_NS, STEP_CV)
"""Key-samples columns that a summary keeps when they are there (older summaries lack them)."""
RUN_MEDIANS_NS: Final = "run_medians_ns"
"""Of a frame pooled from several runs (:func:`pool_runs`): the median of each run the key
appeared in (a float array); what the between-run test compares."""
RUNS: Final = "runs"
"""Of a pooled frame: the runs it was pooled from (the same in every row)."""
KEY_COLUMNS: Final = (col.LEVEL, col.KIND, col.NAME, KEY, PARENT_KEY, COUNT, TOTAL_NS, SAMPLES_NS, SAMPLE_COUNT,
                      col.INPUT_SHAPES, KERNELS_PER_STEP, INPUT_DTYPES)

# columns of a diff table (one row per key of either run)
BASE_COUNT: Final = "base_count"
NEW_COUNT: Final = "new_count"
BASE_TOTAL_NS: Final = "base_total_ns"
NEW_TOTAL_NS: Final = "new_total_ns"
BASE_MEDIAN_NS: Final = "base_median_ns"
NEW_MEDIAN_NS: Final = "new_median_ns"
DELTA_NS: Final = "delta_ns"
"""Change of the median per-step duration, new minus base."""
RATIO: Final = "ratio"
P_VALUE: Final = "p_value"
Q_VALUE: Final = "q_value"
"""``p_value`` adjusted by Benjamini-Hochberg over every key tested."""
VERDICT: Final = "verdict"
DEPTH: Final = "depth"
"""How far below the top of the breakdown a key is listed."""
EXPLAINS: Final = "explains"
"""Share of the parent key's delta that this key's delta accounts for."""
TEST: Final = "test"
BASE_SAMPLES: Final = "base_samples"
NEW_SAMPLES: Final = "new_samples"
BASE_CV: Final = "base_cv"
NEW_CV: Final = "new_cv"
"""Coefficient of variation (standard deviation over mean) of each side's samples."""
NOTE: Final = "note"
RUN_P_VALUE: Final = "run_p_value"
"""With several runs per side: the t test of the runs' medians (NaN otherwise)."""
BASE_RUNS: Final = "base_runs"
NEW_RUNS: Final = "new_runs"
"""Runs pooled on each side (1 for a single trace or summary)."""
ADJUSTED_RATIO: Final = "adjusted_ratio"
"""What the verdict judged: ``ratio``, or, where the new run's times were divided by a factor
(its machine's speed against the base's, or with ``normalize`` the common shift), the ratio
after that division."""
ADJUSTED_DELTA_NS: Final = "adjusted_delta_ns"
"""``delta_ns`` as the verdict judged it (see ``adjusted_ratio``); ``explains`` and the
breakdown are in these terms."""
DETECTABLE: Final = "detectable_change"
"""The smallest relative change of a key's median that its samples could have shown (at its
family's share of the false-discovery rate, with 80% power), after the floors the machine's
noise and the runs' scatter set; infinite where too few steps make any verdict impossible."""
ROOT_FAMILY: Final = "root_family"
"""Key of ``table.attrs``: how many keys the first family of the hierarchical test held (the
top-level keys tested: model calls, steps)."""
LARGEST_FAMILY: Final = "largest_family"
"""Key of ``table.attrs``: the most keys one family of the hierarchical test held."""
BASE_CI_NS: Final = "base_ci_ns"
NEW_CI_NS: Final = "new_ci_ns"
"""Of two leveled traces: each side's 95% interval half-width (``ci_ns`` of the key; NaN elsewhere)."""
RELATIVE_RATIO: Final = "relative_ratio"
"""``ratio`` over the new run's common shift: a secondary view of which keys moved more (or less)
than the run as a whole, never what the verdict judged unless ``normalize`` was asked for."""
COMMON_SHIFT: Final = "common_shift"
"""Key of ``table.attrs`` that holds the new run's common shift."""
JUDGED_FACTOR: Final = "judged_factor"
"""Key of ``table.attrs`` that holds what the new run's times were divided by before judging."""
MIN_SHIFT_KEYS: Final = 3
"""Keys below the model level a common shift needs."""
KEY_SCATTER: Final = "key_scatter"
"""Key of ``table.attrs`` that holds how far the keys' ratios scattered around the common shift."""
SCATTER_FLOOR: Final = "scatter_floor"
"""Key of ``table.attrs`` that holds the smallest change a key judged from one run a side needed."""
MIN_SCATTER_KEYS: Final = 6
"""Keys below the model level, each long enough to be judged, that a scatter needs."""
UNIFORM_SHIFT_FLOOR: Final = 0.25
"""The smallest move of a whole run (every key alike, after any machine-speed correction) judged
from one run a side. Identical runs of one program, each its own process on a busy 2-core
machine, moved as a whole by up to 20% against each other (benchmarks/results/diff_loaded.md),
with the machine's own probe unmoved: a process's memory and caches fall differently."""
UNJUDGED_SHIFT: Final = "unjudged_shift"
"""Key of ``table.attrs``: the whole run's move that keys were not judged on (1.0: none)."""
WAITED_KEYS: Final = "waited_keys"
"""Key of ``table.attrs``: how many keys stayed unchanged because their change was within the
slower run's wait for a CPU per step (one run a side, a loaded machine)."""
SCATTER_FACTOR: Final = 3.0
"""How many robust standard deviations of the keys' scatter a one-run-a-side change must pass."""
MAX_SCATTER_FLOOR: Final = UNIFORM_SHIFT_FLOOR
"""The most the keys' scatter raises the change a key needs from one run a side. Processes of one
program sit apart by less than a whole run moves (:data:`UNIFORM_SHIFT_FLOOR`); keys that scatter
more were moved by a real change that moved different work by different amounts (float64 doubled
a model's matrix products and moved its ReLUs by 1.2x to 2.5x), which must not hide it."""
DIFF_COLUMNS: Final = (col.LEVEL, col.KIND, KEY, BASE_COUNT, NEW_COUNT, BASE_TOTAL_NS, NEW_TOTAL_NS, BASE_MEDIAN_NS,
                       NEW_MEDIAN_NS, DELTA_NS, RATIO, P_VALUE, VERDICT, EXPLAINS, col.NAME, PARENT_KEY, Q_VALUE,
                       TEST, BASE_SAMPLES, NEW_SAMPLES, BASE_CV, NEW_CV, ADJUSTED_RATIO, ADJUSTED_DELTA_NS, NOTE,
                       RUN_P_VALUE, BASE_RUNS, NEW_RUNS, RELATIVE_RATIO, BASE_CI_NS, NEW_CI_NS, DETECTABLE)

# columns of a changes frame
CHANGE: Final = "change"
BASE_VALUE: Final = "base"
NEW_VALUE: Final = "new"


class Change(str, enum.Enum):
    """A change of structure between two runs."""

    ADDED = "added"
    """Spans present only in the new run (the root of an added subtree, with its size)."""
    REMOVED = "removed"
    INPUT_SHAPES = "input shapes"
    INPUT_DTYPES = "input dtypes"
    """An operator's inputs changed dtype (float32 to bfloat16 under autocast, say)."""
    KERNEL_COUNT = "kernel count"
    """A layer launches a different number of kernels per step (a fusion lost or gained)."""
    MEMORY_COPIES = "memory copies"
    SYNCHRONISATIONS = "synchronisations"


# ---------------------------------------------------------------------------------------------
# samples
