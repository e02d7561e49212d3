"""Data curricula: blend weights and a sequence length that change at given steps, exactly on resume.

A curriculum is a list of phases, each lasting until a step (or a token count, a whole number of steps), each with
its blend weights and/or its sequence length (shorter sequences early, as OLMo-core's sequence-length curriculum):

    [[data.curriculum]]                     # steps 1..200: short samples, mostly web
    until_step = 200
    seq_length = 512
    weights = [0.9, 0.1]
    [[data.curriculum]]                     # to schedule.max_steps: full length, more code
    weights = [0.6, 0.4]

Tokens per step stay constant (schedule.global_batch_tokens), and so do tokens per micro-batch: a phase of
seq_length S serves micro_batch_size * L / S samples of S tokens per micro-batch (L = model.seq_length), as
OLMo-core keeps its batch size in tokens and changes it in instances. So the learning-rate schedule, the step count,
gradient accumulation and the activation memory of a micro-batch are the same in every phase, and the loader counts
in *units* of L tokens: unit u of the run is r = L / S samples of phase length S. Megatron's sampler, its state (the
units consumed) and the elastic resume on another world size are unchanged; a phase starts on a step boundary, so no
micro-batch spans two phases.

Each source and each length has one GPTDataset (the train split, Megatron semantics) sized to what all phases of that
length take from it; a phase continues where the earlier phases of its length stopped in each source, so a sample is
never served twice within an epoch of its source. Phases of different lengths cut the documents anew: a document read
at 512 tokens may be read again at 2048 (as in a next epoch). Within a phase, the blend is Megatron's greedy one
(blended.build_blending_indices) over the sources of positive weight.

Example:
    >>> c = Curriculum.from_table([{"until_step": 2, "seq_length": 16}, {}], max_steps=4, global_batch_tokens=128,
    ...                           seq_length=32)
    >>> [(p.start_step, p.end_step, p.seq_length, p.repeat) for p in c.phases], c.units_per_step
    ([(0, 2, 16, 2), (2, 4, 32, 1)], 4)
    >>> c.locate(9)   # unit 9 (step 3): phase 1, its unit 1
    (1, 1)
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from corpusforge.configs import ConfigError

PHASE_KEYS = ("until_step", "until_tokens", "weights", "seq_length")


@dataclass(frozen=True)
class Phase:
    """Steps [start_step, end_step) of a run (0-based), read at seq_length with these blend weights."""

    start_step: int
    end_step: int
    seq_length: int
    """Tokens per sample in this phase; divides the model's seq_length."""
    repeat: int
    """Samples per loader unit: model.seq_length / seq_length."""
    weights: tuple[float, ...] | None
    """Normalised blend weights, one per source (0: not read in this phase); None for a single source."""

    def describe(self) -> dict[str, Any]:
        return {
            "steps": [self.start_step + 1, self.end_step],
            "seq_length": self.seq_length,
            "weights": list(self.weights) if self.weights is not None else None,
        }


@dataclass(frozen=True)
class Curriculum:
    """The phases of a run and the map from a loader unit (L tokens of the global order) to (phase, unit in it)."""

    phases: tuple[Phase, ...]
    unit_length: int
    """L: model.seq_length, the tokens of one loader unit."""
    units_per_step: int
    """global_batch_tokens / L."""

    @classmethod
    def from_table(
        cls,
        table: Sequence[Any],
        max_steps: int,
        global_batch_tokens: int,
        seq_length: int,
        path: str | Sequence[Any] = "",
    ) -> Curriculum:
        """The curriculum of `data.curriculum` (a list of tables), checked: one ConfigError line per mistake, naming
        the phase and the fix. `path` is data.path (its prefixes and weights: a phase without weights keeps them).

        Example:
            >>> Curriculum.from_table([{"until_step": 10, "weights": [1, 3]}, {}], 20, 1024, 128,
            ...                       ["a", 0.5, "b", 0.5]).phases[1].weights
            (0.5, 0.5)
        """
        if not isinstance(table, list | tuple) or not table:
            raise ConfigError(
                "data.curriculum: give a list of phases, e.g. [{until_step=100, seq_length=512}, {}]",
                ["data.curriculum"],
            )
        sources, path_weights = _blend_shape(path)
        phases, start = [], 0
        for i, entry in enumerate(table):
            where = f"data.curriculum[{i}]"
            last = i == len(table) - 1
            end = _phase_end(entry, where, last, max_steps, global_batch_tokens)
            if end <= start:
                raise ConfigError(
                    f"{where}: ends at step {end}, not after the previous phase's end (step {start}); "
                    "give each phase a later until_step",
                    ["data.curriculum"],
                )
            length = _phase_length(entry, where, seq_length)
            weights = _phase_weights(entry, where, sources, path_weights)
            phases.append(Phase(start, end, length, seq_length // length, weights))
            start = end
        if global_batch_tokens % seq_length:
            raise ConfigError(
                f"data.curriculum: schedule.global_batch_tokens {global_batch_tokens} is not a multiple "
                f"of model.seq_length {seq_length}",
                ["data.curriculum"],
            )
        return cls(tuple(phases), seq_length, global_batch_tokens // seq_length)

    @property
    def unit_ends(self) -> np.ndarray:
        """(P,) int64: the loader unit where each phase ends (exclusive)."""
        return np.array([p.end_step * self.units_per_step for p in self.phases], np.int64)

    def units(self, phase: int) -> int:
        p = self.phases[phase]
        return (p.end_step - p.start_step) * self.units_per_step

    def locate(self, unit: int) -> tuple[int, int]:
        """(phase, unit within the phase) of a loader unit: one binary search over the phases."""
        k = int(np.searchsorted(self.unit_ends, unit, side="right"))
        if not 0 <= unit < self.unit_ends[-1]:
            raise IndexError(f"loader unit {unit} is not in [0, {int(self.unit_ends[-1])})")
        return k, unit - self.phases[k].start_step * self.units_per_step

    def describe(self) -> list[dict[str, Any]]:
        return [p.describe() for p in self.phases]


def _blend_shape(path: str | Sequence[Any]) -> tuple[int, list[float] | None]:
    """(number of prefixes, their weights or None) of data.path, without opening anything."""
    if isinstance(path, str):
        return 1, None
    items = list(path)
    numbers = [x for x in items if isinstance(x, int | float) and not isinstance(x, bool)]
    if not numbers:
        return len(items), None
    return len(items) - len(numbers), [float(x) for x in numbers]


def _phase_end(entry: Any, where: str, last: bool, max_steps: int, global_batch_tokens: int) -> int:
    if not isinstance(entry, dict):
        raise ConfigError(
            f"{where} = {entry!r}: expected a table such as {{until_step=100, weights=[0.7, 0.3]}}", ["data.curriculum"]
        )
    for key in entry:
        if key not in PHASE_KEYS:
            close = difflib.get_close_matches(key, PHASE_KEYS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"a phase has {', '.join(PHASE_KEYS)}"
            raise ConfigError(f"{where}: unknown key {key!r}; {hint}", ["data.curriculum"])
    step, tokens = entry.get("until_step"), entry.get("until_tokens")
    if step is not None and tokens is not None:
        raise ConfigError(f"{where}: give until_step or until_tokens, not both", ["data.curriculum"])
    for key, value in (("until_step", step), ("until_tokens", tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}: {key} = {value!r}: expected a whole number of at least 1", ["data.curriculum"])
    if tokens is not None:
        if tokens % global_batch_tokens:
            near = max(1, round(tokens / global_batch_tokens)) * global_batch_tokens
            raise ConfigError(
                f"{where}: until_tokens = {tokens} is not a whole number of steps of "
                f"schedule.global_batch_tokens {global_batch_tokens}; use e.g. until_tokens = {near}",
                ["data.curriculum"],
            )
        step = tokens // global_batch_tokens
    if step is None:
        if not last:
            raise ConfigError(
                f"{where}: give until_step or until_tokens (only the last phase may run to "
                "schedule.max_steps without one)",
                ["data.curriculum"],
            )
        return max_steps
    if last and step != max_steps:
        raise ConfigError(
            f"{where}: the last phase ends at step {step}, the run at schedule.max_steps {max_steps}; "
            "drop the last phase's until_step to run it to the end",
            ["data.curriculum"],
        )
    if step > max_steps:
        raise ConfigError(
            f"{where}: ends at step {step}, after schedule.max_steps {max_steps}; end it earlier or "
            "raise schedule.max_steps",
            ["data.curriculum"],
        )
    return step


def _phase_length(entry: dict, where: str, seq_length: int) -> int:
    length = entry.get("seq_length", seq_length)
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ConfigError(
            f"{where}: seq_length = {length!r}: expected a whole number of at least 1", ["data.curriculum"]
        )
    if seq_length % length:
        fits = [d for d in range(1, seq_length + 1) if seq_length % d == 0 and d <= length][-1]
        raise ConfigError(
            f"{where}: seq_length = {length} does not divide model.seq_length {seq_length} (the model's "
            f"longest; a micro-batch keeps its tokens); use e.g. {fits}",
            ["data.curriculum", "model.seq_length"],
        )
    return length


def _phase_weights(entry: dict, where: str, sources: int, path_weights: list[float] | None) -> tuple[float, ...] | None:
    weights = entry.get("weights")
    if weights is None:
        if sources > 1 and path_weights is None:
            raise ConfigError(
                f"{where}: data.path blends {sources} datasets without weights; give this phase weights "
                f"= [{', '.join(['1'] * sources)}] or weights in data.path",
                ["data.curriculum"],
            )
        weights = path_weights
    elif sources == 1:
        raise ConfigError(
            f"{where}: weights = {weights!r}, but data.path is one dataset; give data.path a blend "
            "[prefix, weight, ...] or drop the weights",
            ["data.curriculum", "data.path"],
        )
    if weights is None:
        return None
    ok = isinstance(weights, list | tuple) and all(
        isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) and w >= 0 for w in weights
    )
    if not ok or not sum(weights) > 0:
        raise ConfigError(
            f"{where}: weights = {weights!r}: give {sources} numbers >= 0 (0: the dataset is not read "
            "in this phase), not all 0",
            ["data.curriculum"],
        )
    if len(weights) != sources:
        raise ConfigError(
            f"{where}: weights = {weights!r} gives {len(weights)} weight(s) for the {sources} datasets "
            "of data.path, in their order",
            ["data.curriculum", "data.path"],
        )
    total = float(np.sum(np.array(weights, np.float64)))
    return tuple(float(w) / total for w in weights)


# ---------------------------------------------------------------------------------------------------------------
# the dataset


class CurriculumDataset:
    """The samples of a curriculum, addressed in loader units (L = model.seq_length tokens): unit u of phase k is
    samples u*r .. u*r + r - 1 of that phase's blend (r = L / S_k), so a micro-batch of B units is B*r samples.

    Reads as a GPTDataset or BlendedDataset does for the loader (read_raw, __getitems__, its own assemble for the
    workers' raw batches, fingerprint, prefetch); the fingerprint holds the phases, so a loader state is refused by a
    curriculum that is not the one it was saved with.

    Example:
        >>> train = build_curriculum_dataset(curriculum, ["out/a_text_document", "out/b_text_document"], "969,30,1",
        ...                                  seed=1234, cache_dir="cache/")
        >>> train.__getitems__([0, 1])["tokens"].shape      # 2 units of a phase of seq_length L/2
        torch.Size([4, 1024])
    """

    def __init__(
        self,
        curriculum: Curriculum,
        sources: dict[tuple[int, int], Any],
        prefixes: Sequence[str],
        indices: list[dict[str, np.ndarray]],
        configs: dict[int, Any],
    ) -> None:
        self.curriculum, self.sources, self.prefixes = curriculum, sources, list(prefixes)
        self.indices = indices  # per phase: dataset_index (n,) int16, dataset_sample_index (n,) int64
        self.configs = configs  # seq_length -> GPTDatasetConfig
        self.config = configs[curriculum.unit_length]  # the options: every length's are the same
        self.unit_ends = curriculum.unit_ends
        self.ends = self.unit_ends.tolist()  # bisected per batch: cheaper than numpy for a few phases
        self.starts = [p.start_step * curriculum.units_per_step for p in curriculum.phases]
        # one dataset per source for the run summary (read modes) and the tokens-in-the-split check
        self.datasets = [
            next(ds for (d, _), ds in sources.items() if d == i)
            for i in range(len(prefixes))
            if any(d == i for d, _ in sources)
        ]
        self.blended = curriculum.phases[0].weights is not None
        self.description = {
            "class": "CurriculumDataset",
            "phases": curriculum.describe(),
            "unit_length": curriculum.unit_length,
            "units_per_step": curriculum.units_per_step,
            "sources": {f"{d}@{s}": ds.description for (d, s), ds in sorted(sources.items())},
        }

    def __len__(self) -> int:
        return int(self.unit_ends[-1])

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {**self.description, "options": self.config.describe()}

    def load_kernels(self) -> None:
        for part in self.sources.values():
            part.load_kernels()

    def _samples(self, ids: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """(phase, source of each sample, its sample in that source's dataset) of units `ids`, r samples a unit."""
        if not len(ids):
            return 0, np.empty(0, np.int16), np.empty(0, np.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= len(self):
            raise IndexError(f"loader units out of range [0, {len(self)}): {lo}..{hi}")
        first, last = bisect.bisect_right(self.ends, lo), bisect.bisect_right(self.ends, hi)
        p = self.curriculum.phases[first]
        if first == last:  # a loader's micro-batch: phases start on step boundaries
            short = ids - self.starts[first]
            if p.repeat > 1:
                short = (short[:, None] * p.repeat + np.arange(p.repeat)).reshape(-1)
            arrays = self.indices[first]
            return first, arrays["dataset_index"][short], arrays["dataset_sample_index"][short]
        k = np.searchsorted(self.unit_ends, ids, side="right")
        other = self.curriculum.phases[last]
        if other.seq_length != p.seq_length:
            raise ValueError(
                f"loader units {lo}..{hi} span phases of seq_length {p.seq_length} and {other.seq_length}; read them "
                "apart"
            )
        which, inner = np.empty(len(ids) * p.repeat, np.int16), np.empty(len(ids) * p.repeat, np.int64)
        for q in np.unique(k):
            rows = np.flatnonzero(np.repeat(k == q, p.repeat))
            short = ((ids[k == q] - self.starts[q])[:, None] * p.repeat + np.arange(p.repeat)).reshape(-1)
            which[rows] = self.indices[q]["dataset_index"][short]
            inner[rows] = self.indices[q]["dataset_sample_index"][short]
        return first, which, inner

    def read_raw(self, ids) -> Any:
        """The text of units `ids` as read (r rows each), with each row's source when the curriculum blends."""
        from corpusforge.data.batch import RawBatch

        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        phase, which, inner = self._samples(ids)
        s = self.curriculum.phases[phase].seq_length
        config = self.configs[s]
        masks = {int(d): which == d for d in np.unique(which)}
        parts = {d: (rows, self.sources[(d, s)].read_raw(inner[rows])) for d, rows in masks.items()}
        if len(parts) == 1:  # one source: its batch as it is, rows in order
            raw = next(iter(parts.values()))[1]
            return dataclasses.replace(raw, dataset_id=which.astype(np.int32)) if self.blended else raw
        dtype = np.result_type(np.uint16, *(raw.text.dtype for _, raw in parts.values()))
        text = np.empty((len(which), s + config.extra), dtype=dtype)
        for rows, raw in parts.values():
            text[rows] = raw.text
        cu_seqlens = max_seqlen = None
        if config.document_boundaries:
            cu_seqlens, max_seqlen = np.empty((len(which), s + 1), np.int32), np.empty(len(which), np.int32)
            for rows, raw in parts.values():
                cu_seqlens[rows], max_seqlen[rows] = raw.cu_seqlens, raw.max_seqlen
        padded = any(raw.maybe_padded for _, raw in parts.values())
        return RawBatch(text, padded, which.astype(np.int32), cu_seqlens, max_seqlen)

    def assemble(self, raw: Any, as_torch: bool = False, pin_memory: bool = False) -> dict[str, Any]:
        """The fields of a raw batch of any phase (its width says its seq_length)."""
        from corpusforge.data.batch import assemble

        return assemble(raw, self.config, as_torch=as_torch, pin_memory=pin_memory)  # widths come from the text

    def get_batch(self, ids) -> dict[str, np.ndarray]:
        return self.assemble(self.read_raw(ids))

    def __getitems__(self, ids: list[int]) -> dict[str, Any]:
        from corpusforge.data.gpt_dataset import prefetch_upcoming

        prefetch_upcoming(self, ids)
        return self.assemble(self.read_raw(ids), as_torch=True)

    @property
    def remote(self) -> bool:
        return any(part.remote for part in self.sources.values())

    def prefetch(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < len(self))]
        if not len(ids):
            return
        phase, which, inner = self._samples(
            ids[np.searchsorted(self.unit_ends, ids, "right") == np.searchsorted(self.unit_ends, ids[0], "right")]
        )
        s = self.curriculum.phases[phase].seq_length
        for d in np.unique(which):
            part = self.sources[(int(d), s)]
            if part.remote:
                part.prefetch(inner[which == d])

    def __getstate__(self) -> dict[str, Any]:
        from corpusforge.data.cache import picklable

        state = self.__dict__.copy()
        state["indices"] = [{k: picklable(v) for k, v in arrays.items()} for arrays in self.indices]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from corpusforge.data.cache import unpickled

        state["indices"] = [{k: unpickled(v) for k, v in arrays.items()} for arrays in state["indices"]]
        self.__dict__.update(state)

    def tokens(self) -> dict[str, Any]:
        """What the run reads: tokens per phase, per source and per sequence length (the dry run's report)."""
        per_source = [0] * len(self.prefixes)
        per_length: dict[int, int] = {}
        phases = []
        for k, p in enumerate(self.curriculum.phases):
            counts = np.bincount(self.indices[k]["dataset_index"], minlength=len(self.prefixes)).tolist()
            tokens = [int(c) * p.seq_length for c in counts]
            for d, t in enumerate(tokens):
                per_source[d] += t
            per_length[p.seq_length] = per_length.get(p.seq_length, 0) + sum(tokens)
            phases.append(
                {
                    **p.describe(),
                    "samples_per_step": self.curriculum.units_per_step * p.repeat,
                    "tokens": sum(tokens),
                    "tokens_per_source": tokens,
                }
            )
        return {
            "phases": phases,
            "tokens_per_source": dict(zip(self.prefixes, per_source)),
            "tokens_per_seq_length": {str(s): t for s, t in sorted(per_length.items())},
        }

    def __repr__(self) -> str:
        phases, sources = len(self.curriculum.phases), len(self.prefixes)
        return f"CurriculumDataset({phases} phases, {sources} sources, units={len(self)})"


def _phase_indices(p: Phase, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, sample index within the phase's draw from each source) of a phase of `samples` samples: the
    greedy Megatron blend over the sources of positive weight."""
    from corpusforge.data.blended import build_blending_indices

    if p.weights is None:
        return np.zeros(samples, np.int16), np.arange(samples, dtype=np.int64)
    active = np.flatnonzero(np.array(p.weights) > 0)
    weights = np.array(p.weights)[active]
    index, inner = build_blending_indices((weights / weights.sum()).tolist(), samples)
    return active.astype(np.int16)[index], inner


def build_curriculum_dataset(
    curriculum: Curriculum,
    prefixes: Sequence[str],
    split: str,
    seed: int,
    cache_dir: Any = None,
    storage: Any = None,
    **options: Any,
) -> CurriculumDataset:
    """The train split of `prefixes` as the curriculum serves it: per source and length one GPTDataset of what the
    phases take from it, per phase its blend's indices, offset past what earlier phases of its length took. The
    indices are cached as the datasets' are (IndexCache under cache_dir). `options` are GPTDatasetConfig's.

    Example:
        >>> c = Curriculum.from_table([{"until_step": 100, "seq_length": 512}, {}], 400, 2**19, 2048)
        >>> train = build_curriculum_dataset(c, ["out/a_text_document"], "969,30,1", seed=1234, cache_dir="cache/")
    """
    from corpusforge.data.cache import IndexCache, completing_after
    from corpusforge.data.gpt_dataset import GPTDataset, GPTDatasetConfig, split_ranges
    from corpusforge.storage.datasets import open_datasets

    indexed = open_datasets(list(prefixes), storage)
    cache = IndexCache(cache_dir)
    taken: dict[tuple[int, int], int] = {}  # (source, seq_length) -> samples the phases so far took
    indices = []
    for k, p in enumerate(curriculum.phases):
        samples = curriculum.units(k) * p.repeat
        # the phase's samples in each source's dataset of its length start past what earlier phases took there
        offsets = [taken.get((d, p.seq_length), 0) for d in range(len(prefixes))]
        description = {"kind": "curriculum-phase", "weights": p.weights, "samples": samples, "offsets": offsets}

        def build(p=p, samples=samples, offsets=offsets) -> dict[str, np.ndarray]:
            which, inner = _phase_indices(p, samples)
            return {"dataset_index": which, "dataset_sample_index": inner + np.array(offsets, np.int64)[which]}

        arrays, _ = cache.get_or_build("CurriculumPhase", description, build)
        counts = np.bincount(arrays["dataset_index"], minlength=len(prefixes))
        for d in np.flatnonzero(counts):
            taken[(int(d), p.seq_length)] = offsets[d] + int(counts[d])
        indices.append(arrays)
    configs = {
        s: GPTDatasetConfig(seq_length=s, seed=seed, split=split, **options)
        for s in {p.seq_length for p in curriculum.phases} | {curriculum.unit_length}
    }
    sources = {}
    with completing_after():
        for (d, s), count in sorted(taken.items()):
            bounds = split_ranges(split, len(indexed[d]))[0]
            if bounds is None or bounds[1] <= bounds[0]:
                raise ValueError(f"{prefixes[d]}: split {split!r} gives the train split no sequences")
            sources[(d, s)] = GPTDataset(indexed[d], "train", bounds, count, configs[s], cache)
    return CurriculumDataset(curriculum, sources, prefixes, indices, configs)


def report_lines(report: dict[str, Any]) -> list[str]:
    """The dry run's lines for CurriculumDataset.tokens(): one per phase, then the tokens per source and per length.

    Example:
        >>> report_lines(train.tokens())[0]
        'curriculum: phase 1 steps 1-200: seq_length 512, 1024 samples/step, weights [0.9, 0.1]: 104,857,600 tokens'
    """
    lines = []
    for k, p in enumerate(report["phases"]):
        weights = f", weights {[round(w, 4) for w in p['weights']]}" if p["weights"] is not None else ""
        lines.append(
            f"curriculum: phase {k + 1} steps {p['steps'][0]}-{p['steps'][1]}: seq_length {p['seq_length']}, "
            f"{p['samples_per_step']} samples/step{weights}: {p['tokens']:,} tokens"
        )
    total = sum(report["tokens_per_source"].values()) or 1
    for source, tokens in report["tokens_per_source"].items():
        lines.append(f"  source {source}: {tokens:,} tokens ({100 * tokens / total:.1f}%)")
    for length, tokens in report["tokens_per_seq_length"].items():
        lines.append(f"  seq_length {length}: {tokens:,} tokens ({100 * tokens / total:.1f}%)")
    return lines
