"""No host synchronisation in the device job.

The step loop's one deliberate wait is on the completion event of a batch's copied tokens
(`CudaStream`'s pending result). Everything else the device side does per step - table writes, the
forward (eager or through the graph runner), sampling with every stage, logprobs, penalty-state
updates - must only enqueue work. On the CPU nothing ever blocks, so this test watches instead: it runs
engine workloads with `ModelRunner.run` under a torch function mode and a dispatch mode that raise on
every operation that, on a GPU, reads device memory from the host (`.item()`, `int()`/`bool()` of a
tensor, `.tolist()`, `.cpu()`, boolean-mask indexing, `nonzero`, ...).

Pageable host->device copies cannot be seen on the CPU; the device job has none by construction: the
batch arrives through `dataclass_to_device` (pinned, non-blocking), and the sampler's penalty-state
inputs go through `gapless.tensors.to_device` (likewise). On a GPU, test_cuda.py runs the loop under
`torch.cuda.set_sync_debug_mode("error")`, which also catches those.

How many copies a step makes is seen on the CPU too: what crosses the stream boundary is the batch, and
moving it to another device (here `meta`, which copies no data) through `dataclass_to_device` shows each
host-to-device copy as an `aten._to_copy` from the CPU. A decode step makes at most 2 (it makes 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import gapless.engine.stream.process
import gapless.sampling.sampler
from gapless import LLM, SamplingParams
from gapless.engine.batch import TableWrites
from gapless.engine.request import Req
from gapless.engine.scheduler.build import BatchBuilder
from gapless.engine.scheduler.kv import DecodeSlots
from gapless.tensors import ALIGN_BYTES, dataclass_to_device, map_tensors, packed
from gapless.testing.hf_reference import make_prompts

aten = torch.ops.aten


class HostSync(AssertionError):
    pass


# Python-level reads of tensor data into host values (most never reach the dispatcher)
_SYNC_FUNCTIONS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.__contains__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.Tensor.unique,
    torch.unique,
    torch.equal,
    torch.Tensor.equal,
    torch.argwhere,
}
# aten ops whose result size or value the host must read
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.equal.default,
}
_INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}


def _bool_index(indices: object) -> bool:
    if isinstance(indices, torch.Tensor):
        return indices.dtype in (torch.bool, torch.uint8)
    if isinstance(indices, (list, tuple)):
        return any(_bool_index(i) for i in indices)
    return False


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if func in _SYNC_FUNCTIONS:
            raise HostSync(f"host sync in the device job: {name}")
        if name in ("__getitem__", "__setitem__") and _bool_index(args[1]):
            raise HostSync(f"host sync in the device job: boolean-mask {name}")
        if name == "repeat_interleave" and isinstance(
            args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor
        ):
            if kwargs.get("output_size") is None:
                raise HostSync("host sync in the device job: repeat_interleave without output_size")
        if func is torch.where and len(args) + len(kwargs) == 1:
            raise HostSync("host sync in the device job: torch.where(condition)")
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            raise HostSync(f"host sync in the device job: {func}")
        if func in _INDEX_OPS and _bool_index(args[1]):
            raise HostSync(f"host sync in the device job: {func} with a boolean mask")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostSync(f"host sync in the device job: {func} without output_size")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_syncs() -> Iterator[None]:
    with _Functions(), _Ops():
        yield


def test_the_watch_catches_syncs():
    t = torch.arange(6.0)
    for sync in (
        lambda: t.sum().item(),
        lambda: int(t[0]),
        lambda: bool((t > 2).any()),
        lambda: t.tolist(),
        lambda: t[t > 2],
        lambda: t.masked_fill(t > 2, 0).nonzero(),
        lambda: t.__setitem__(t > 2, 0.0),
        lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        lambda: [0, 1, 2][torch.tensor(1)],
        lambda: f"{t[0]:.1f}",
    ):
        with forbid_host_syncs(), pytest.raises(HostSync):
            sync()
    with forbid_host_syncs():  # what the device job does instead
        t.masked_fill(t > 2, 0.0).argmax()
        t[torch.tensor([0, 2])].sum()
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]), output_size=3)
        torch.where(t > 2, t, 0.0)


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = make_prompts(vocab, n=10, seed=5, shared_prefix=32, max_len=60)
    kinds = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.9, top_k=12, top_p=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.7, min_p=0.1, logprobs=3, ignore_eos=True),
        SamplingParams(
            max_tokens=9,
            temperature=1.0,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            seed=2,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True),
    ]
    return prompts, [kinds[i % len(kinds)] for i in range(len(prompts))]


LOOPS = {
    "plain": {"overlap": False},
    "overlap": {"overlap": True, "cpu_worker": "thread"},
}


@pytest.mark.parametrize("loop", LOOPS)
def test_device_job_never_syncs(ckpt_factory, loop):
    """Extends with cached prefixes and chunks, decodes eager (6 rows) and through the graph runner's
    padded buffers (<= 4 rows), every sampling stage, penalties, logprobs and prompt logprobs (scored in
    chunks of 32): no host sync anywhere. And every vector of every batch starts 16-byte aligned in its
    buffer, as its device copy will (Triton compiles a kernel apart for each pattern of 16-byte
    alignment among its pointers: views at any offset compiled again mid-run)."""
    path = str(ckpt_factory("llama"))
    with LLM(
        path,
        device="cpu",
        page_size=4,
        kv_cache_tokens=2048,
        chunked_prefill_size=32,
        max_running_requests=6,
        cuda_graph_max_bs=4,
        **LOOPS[loop],
    ) as llm:
        runner = llm.engine.runner
        run = runner.run

        def watched(batch):
            assert not _misaligned(batch)
            with forbid_host_syncs():
                return run(batch)

        runner.run = watched
        prompts, params = _workload(runner.model_config.vocab_size)
        prompts, params = prompts + [prompts[0]], params + [SamplingParams(max_tokens=3, prompt_logprobs=2)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
        assert len(outs[-1].prompt_logprobs) == len(prompts[-1])
        assert llm.engine.stats.cached_prompt_tokens > 0
        assert runner.graphs is not None and sum(runner.graphs.runs.values()) > 0
        assert llm.engine.stats.decode_batches > sum(runner.graphs.runs.values())  # eager decodes too
        llm.check_integrity()


def _misaligned(batch) -> list[str]:
    """The batch's tensors (nested ones too) that start at an offset of their buffer that is not a
    multiple of `ALIGN_BYTES`, with their offsets."""
    found: list[str] = []

    def check(t: torch.Tensor) -> torch.Tensor:
        if t.numel() and t.storage_offset() * t.element_size() % ALIGN_BYTES:
            found.append(f"{tuple(t.shape)} {t.dtype} at byte {t.storage_offset() * t.element_size()}")
        return t

    map_tensors(batch, check)
    return found


def test_packed_views_start_aligned():
    """`packed` pads each part so that every view starts `ALIGN_BYTES` into its buffer, whatever the
    parts' lengths, and keeps their values; a decode's buffer pads its rows the same way."""
    parts = [torch.arange(n) + 10 * n for n in (3, 1, 0, 5, 2)]
    views = packed(*parts)
    assert [v.tolist() for v in views] == [p.tolist() for p in parts]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert [v.storage_offset() * 8 % ALIGN_BYTES for v in views] == [0] * 5
    assert [v.storage_offset() for v in packed(*(p.int() for p in parts))] == [0, 4, 8, 8, 16]
    reqs = [Req(str(i), [1, 2, 3], SamplingParams(), seed=i, arrival=i, row=i, sampled=i) for i in range(3)]
    slots = DecodeSlots(np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([30, 40, 50]))
    batch = BatchBuilder(4, 100).decode(reqs, slots, None).forward
    assert not _misaligned(batch) and batch.positions.tolist() == [3, 4, 5]


class _HostToDevice(TorchDispatchMode):
    """Counts copies from the CPU onto another device."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default:
            src, dst = args[0].device, kwargs.get("device") or args[0].device
        elif func is aten.copy_.default:
            src, dst = args[1].device, args[0].device
        else:
            return func(*args, **kwargs)
        self.copies += src.type == "cpu" and torch.device(dst).type != "cpu"
        return func(*args, **kwargs)


def _copies(batch) -> int:
    with _HostToDevice() as count:
        dataclass_to_device(batch, torch.device("meta"))
    return count.copies


@dataclasses.dataclass
class _Two:
    x: torch.Tensor
    y: tuple[torch.Tensor, ...]


def test_the_count_sees_copies():
    a, b = torch.arange(4), torch.arange(3)
    assert _copies(_Two(a, (b,))) == 2  # two buffers
    x, y = packed(a, b)
    assert _copies(_Two(x, (y, x))) == 1  # views of one buffer move as one copy
    big = torch.arange(100_000)
    assert _copies(_Two(big[:2], (big[5:7],))) == 2  # small views of a large buffer move alone


@pytest.mark.parametrize("loop", LOOPS)
def test_decode_step_copies_once_and_never_syncs(ckpt_factory, loop, monkeypatch):
    """Every decode batch (penalties, logprobs, seeded and greedy rows, requests resumed after a
    retraction) crosses to the device in at most 2 host-to-device copies, its device job copies nothing
    more (the sampler's values are already there, per row) and never syncs."""
    path = str(ckpt_factory("llama"))
    to_device = gapless.sampling.sampler.to_device
    in_job: list[int] = []
    monkeypatch.setattr(
        gapless.sampling.sampler, "to_device", lambda t, d: in_job.append(1) or to_device(t, d)
    )
    with LLM(
        path,
        device="cpu",
        page_size=4,
        kv_cache_tokens=160,  # tight: decodes retract, and resumed requests bring table writes
        chunked_prefill_size=32,
        max_running_requests=6,
        init_new_token_ratio=0.02,  # admit as if requests needed few more tokens
        min_new_token_ratio=0.02,
        **LOOPS[loop],
    ) as llm:
        runner = llm.engine.runner
        run = runner.run
        decodes: list[tuple[int, int]] = []

        def watched(batch):
            before = len(in_job)
            with forbid_host_syncs():
                out = run(batch)
            if batch.is_decode:
                decodes.append((_copies(batch), len(in_job) - before))
            return out

        runner.run = watched
        prompts, params = _workload(runner.model_config.vocab_size)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
        assert llm.engine.stats.retractions > 0
        assert len(decodes) > 10
        assert max(c for c, _ in decodes) <= 2 and all(n == 0 for _, n in decodes)
        llm.check_integrity()


def test_decode_batch_with_table_writes_is_one_buffer():
    """The rare decode that carries request-table writes (queued by a retraction's drain) keeps them in
    its one buffer."""
    reqs = [Req(str(i), [1, 2, 3], SamplingParams(), seed=i, arrival=i, row=i, sampled=i) for i in range(3)]
    slots = DecodeSlots(np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([30, 40, 50]))
    writes = TableWrites(torch.tensor([1, 1]), torch.tensor([0, 1]), torch.tensor([7, 8]))
    batch = BatchBuilder(4, 100).decode(reqs, slots, writes).forward
    assert _copies(batch) == 1
    assert [t.tolist() for t in batch.table_writes] == [[1, 1], [0, 1], [7, 8]]
    assert batch.sample_steps.tolist() == [0, 1, 2] and [r.sampled for r in reqs] == [1, 2, 3]
    assert batch.positions.tolist() == [3, 4, 5] and batch.out_slots.tolist() == [30, 40, 50]
    assert batch.max_seq_len == 6


def test_moving_a_batch_leaves_no_cycle():
    """`dataclass_to_device` (each step's batch, nested tuples included) makes no reference cycle: one
    would keep the device copies it made (in its closure) until a garbage collection."""
    reqs = [Req(str(i), [1, 2, 3], SamplingParams(), seed=i, arrival=i, row=i, sampled=i) for i in range(3)]
    slots = DecodeSlots(np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([30, 40, 50]))
    writes = TableWrites(torch.tensor([1, 1]), torch.tensor([0, 1]), torch.tensor([7, 8]))
    batch = BatchBuilder(4, 100).decode(reqs, slots, writes).forward
    gc.collect()
    gc.disable()
    try:
        moved = dataclass_to_device(batch, torch.device("meta"))
        assert moved.positions.device.type == "meta" and moved.table_writes[0].device.type == "meta"
        del moved
        assert gc.collect() == 0
    finally:
        gc.enable()


def _same_batch(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), f.name
        else:
            assert x == y, f.name


def test_plain_decode_crosses_the_pipe_as_its_buffer(monkeypatch):
    """A plain decode (nearly every step) goes to the device process as its buffer's bytes, not through
    the tensor pickler (its cost dominated the overlap loop's launch at 256 rows), and arrives as the same
    batch, its vectors again views of one writable buffer; a decode carrying table writes still takes
    the general path."""
    reqs = [Req(str(i), [1, 2, 3], SamplingParams(), seed=i, arrival=i, row=i, sampled=i) for i in range(3)]
    slots = DecodeSlots(np.array([0, 1, 2]), np.array([3, 4, 5]), np.array([30, 40, 50]))
    plain = BatchBuilder(4, 100).decode(reqs, slots, None).forward
    writes = TableWrites(torch.tensor([1, 1]), torch.tensor([0, 1]), torch.tensor([7, 8]))
    with_writes = BatchBuilder(4, 100).decode(reqs, slots, writes).forward
    general: list[object] = []
    dumps = gapless.engine.stream.process.dumps
    monkeypatch.setattr(gapless.engine.stream.process, "dumps", lambda obj: general.append(obj) or dumps(obj))
    for batch, pickled in ((plain, 0), (with_writes, 1)):
        general.clear()
        kind, job_id, got = pickle.loads(gapless.engine.stream.process._job_message(7, batch))
        assert (kind, job_id, len(general)) == ("run", 7, pickled)
        _same_batch(batch, got)
        assert _copies(got) == 1
        got.positions[0] = 99  # writable, and its own memory: the host's batch is untouched
        assert batch.positions[0] == 3


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_verify_job_never_syncs(ckpt_factory, algorithm):
    """Speculative decoding's verify batches (drafts looked up, placed and accepted on the device, slots
    taken ahead, retraction under a tight pool), the extends that fill the rows' token history and, with
    n-gram drafts, the plain decodes above the switch-off batch size; verifies and decodes through the
    graph runner's buffers; with a draft model, the verify job also catches the draft up and runs its K
    proposal steps, all placed on the device from the rows' state: no host sync, and each crosses to the
    device in one copy."""
    path = str(ckpt_factory("llama"))
    if algorithm == "ngram":  # larger decode batches run plain, through the graph runner
        spec = dict(speculative_disable_batch_size=3, cuda_graph_max_bs=6)
    else:
        spec = dict(speculative_draft_model=path, cuda_graph_max_bs=6)
    with LLM(
        path,
        device="cpu",
        page_size=4,
        kv_cache_tokens=256,
        chunked_prefill_size=32,
        max_running_requests=6,
        init_new_token_ratio=0.02,
        min_new_token_ratio=0.02,
        speculative_algorithm=algorithm,
        **spec,
        **LOOPS["overlap"],  # (the device job is the same in the plain loop)
    ) as llm:
        runner = llm.engine.runner
        run = runner.run
        verifies: list[int] = []

        def watched(batch):
            with forbid_host_syncs():
                out = run(batch)
            if batch.reads_future_tokens:
                verifies.append(_copies(batch))
            return out

        runner.run = watched
        prompts, params = _workload(runner.model_config.vocab_size)
        outs = llm.generate([p * 3 for p in prompts], params, use_tqdm=False)
        assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
        stats = llm.get_stats()
        drafts = stats["spec_drafted_tokens" if algorithm == "ngram" else "spec_accepted_tokens"]
        assert drafts > 0 and stats["retractions"] > 0
        assert len(verifies) > 5 and max(verifies) == 1
        if algorithm == "ngram":
            assert sum(runner.graphs.runs.values()) > 0
        assert sum(runner.graphs.verify_runs.values()) > 0
        llm.check_integrity()
