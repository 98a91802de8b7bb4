"""Per-token versions from the engine's token counts (vllm_titan_plugin.swap.ledger, .tagging), without a
server. Against a real one: tests/test_reliability.py::test_streams_survive_swaps_under_load."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from titan_rl_ext.wire.protocol import SPANS_FIELD, VERSION_FIELD


def _state(starts: list[tuple[int, int]] | None, n: int) -> Any:
    from vllm_titan_plugin.swap.ledger import STARTS_ATTR

    st = SimpleNamespace(detokenizer=SimpleNamespace(num_output_tokens=lambda: n))
    if starts is not None:
        setattr(st, STARTS_ATTR, starts)
    return st


def test_request_versions_spans_and_lookup() -> None:
    from vllm_titan_plugin.swap.tagging import RequestVersions

    rv = RequestVersions()
    parent = object()
    s1, s0 = _state([(2, 0), (3, 4)], 6), _state([(0, 0)], 2)
    rv.add(s1, parent, 1)  # choices register out of order; n=2 children of one prompt
    rv.add(s0, parent, 0)
    assert rv.spans(0) == [[0, 0, 2]] and rv.spans(1) == [[2, 0, 4], [3, 4, 6]]
    assert [rv.version_at(1, i) for i in (0, 3, 4, 5)] == [2, 2, 3, 3] and rv.version_at(1, None) == 3
    assert rv.spans(2) is None and rv.version_at(5, 0) is None
    assert RequestVersions().spans(0) is None
    rv2 = RequestVersions()
    rv2.add(_state(None, 1), None, 0)  # registered before the hook was installed: no claim
    assert rv2.spans(0) is None and rv2.version_at(0, 0) is None


def test_annotator_tags_each_chunk_with_its_last_token() -> None:
    import asyncio

    from vllm_titan_plugin.swap.tagging import RequestVersions, _Annotator

    rv = RequestVersions()
    rv.add(_state([(5, 0), (6, 3)], 5), None, 0)
    state = SimpleNamespace(version=6, boot_id="b")
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    ann = _Annotator(send, state, rv)
    chunks = [{"choices": [{"index": 0, "token_ids": [1, 2]}]}, {"choices": [{"index": 0, "token_ids": [3, 4]}]},
              {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length"}]}]
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

    async def run() -> None:
        await ann({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await ann({"type": "http.response.body", "body": body[:37], "more_body": True})  # split mid-event
        await ann({"type": "http.response.body", "body": body[37:], "more_body": False})

    asyncio.run(run())
    out = b"".join(m.get("body", b"") for m in sent[1:]).split(b"\n\n")
    got = [json.loads(e[6:]) for e in out if e.startswith(b"data: {")]
    assert [g[VERSION_FIELD] for g in got] == [5, 6, 6]  # tokens 0-1 -> v5; 2-3 straddle -> last is v6
    assert got[-1]["choices"][0][SPANS_FIELD] == [[5, 0, 3], [6, 3, 5]]
    assert SPANS_FIELD not in got[0]["choices"][0] and b"data: [DONE]" in out
    assert (b"x-titan-boot-id", b"b") in sent[0]["headers"]


def test_ledger_turns_engine_counts_into_spans() -> None:
    """The three kinds of request a swap meets: held by the engine (split at its count), registered after
    the utility was sent (all new), finished in the engine before it (all old, even with its last tokens
    still on their way); and a utility that set nothing leaves every request on the old version."""
    from vllm_titan_plugin.swap.ledger import STARTS_ATTR, VersionLedger, spans_of

    ledger = VersionLedger(version=4)
    running, finished, early = _state(None, 0), _state(None, 0), _state(None, 0)
    for st in (running, finished, early):
        ledger.on_register(st)
    ledger.begin(5)
    late = _state(None, 0)
    ledger.on_register(late)  # its ADD message leaves after the utility's
    ledger.commit(5, {"r": 7, "e": 0}, {"r": running, "f": finished, "e": early, "l": late})
    assert getattr(running, STARTS_ATTR) == [(4, 0), (5, 7)]
    assert getattr(early, STARTS_ATTR) == [(4, 0), (5, 0)]  # in the engine, no token yet: all new
    assert getattr(finished, STARTS_ATTR) == [(4, 0)]
    assert getattr(late, STARTS_ATTR) == [(5, 0)]
    assert spans_of(running) == ([(4, 0), (5, 7)], 0)

    ledger.begin(6)
    refused = _state(None, 0)
    ledger.on_register(refused)
    assert getattr(refused, STARTS_ATTR) == [(6, 0)]
    ledger.cancel()  # busy, refused or failed: version 6 never happened
    assert getattr(refused, STARTS_ATTR) == [(5, 0)] and ledger.version == 5
    assert getattr(running, STARTS_ATTR) == [(4, 0), (5, 7)]


def _scale_norms(model: Any) -> None:
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.mul_(1.2)


def test_swap_mid_prefill_starts_the_prompt_over(tiny_ckpt, monkeypatch) -> None:
    """A swap that lands between two chunks of a prompt's prefill: every token the request samples is
    tagged with the new version, so its whole context must be the new weights' too. With BI on, its greedy
    tokens and logprobs equal a request run wholly on the new weights, bit for bit; without the restart the
    first chunk's KV/GDN state (old weights) leaks in (the weights move by 20 %: every logprob changes)."""
    import torch
    from test_vllm_plugin import ENGINE_ENV, _prompts, titan_engine
    from vllm import SamplingParams

    from vllm_titan_plugin.swap.engine import set_weight_version

    for k, v in {**ENGINE_ENV, "TITAN_BATCH_INVARIANT": "1"}.items():
        monkeypatch.setenv(k, v)
    prompt = _prompts([150], seed=3)[0]
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    with titan_engine(tiny_ckpt("qwen3_5", layout="text"), enable_prefix_caching=False, max_num_batched_tokens=64,
                      max_num_seqs=4, long_prefill_token_threshold=64) as llm:
        engine, core = llm.llm_engine, llm.llm_engine.engine_core.engine_core

        def run(rid: str, swap_after_steps: int | None) -> tuple[list[int], list[float], int]:
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            steps, out = 0, None
            while engine.has_unfinished_requests():
                if steps == swap_after_steps:
                    (req,) = core.scheduler.requests.values()  # vLLM adds a suffix to the id
                    assert 0 < req.num_computed_tokens < len(prompt) and req.num_output_tokens == 0
                    llm.apply_model(_scale_norms)
                    set_weight_version(core, 1)
                for o in engine.step():
                    if o.finished:
                        out = o
                steps += 1
            c = out.outputs[0]
            return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], out.num_cached_tokens or 0

        ids_swap, lps_swap, _ = run("mid", swap_after_steps=1)
        ids_new, lps_new, _ = run("after", swap_after_steps=None)
    assert ids_swap == ids_new and torch.equal(torch.tensor(lps_swap), torch.tensor(lps_new)), (lps_swap, lps_new)


class _Req:
    """Stands in for vLLM's ``RequestState``: a plain object (weak-referenceable, like the real one)."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id, self.n = request_id, n
        self.detokenizer = SimpleNamespace(num_output_tokens=lambda: self.n)


def test_commit_tags_a_request_finished_before_the_swap_task_resumed() -> None:
    """vLLM's socket task can read the swap utility's answer and the next step's outputs in one go (zmq returns
    ready messages without yielding): with the output handler already woken by an earlier output, it processes
    the post-swap step -- finishing the request and dropping it from ``request_states`` -- before the swap's
    task resumes and commits. The finished request's last token came from the new weights and must say so.
    Driven through ``orchestrator._set_version`` and asyncio's own scheduling, as vLLM's loop runs them."""
    import asyncio
    import gc
    import weakref

    from vllm_titan_plugin.swap import orchestrator
    from vllm_titan_plugin.swap.ledger import VersionLedger
    from vllm_titan_plugin.swap.tagging import RequestVersions

    async def run() -> tuple[RequestVersions, list[bool], weakref.ref[Any]]:
        loop = asyncio.get_running_loop()
        request_states: dict[str, Any] = {}
        utility: list[asyncio.Future[Any]] = []

        async def call_utility_async(method: str, *args: Any) -> Any:
            utility.append(loop.create_future())
            return await utility[0]

        engine = SimpleNamespace(output_processor=SimpleNamespace(request_states=request_states),
                                 engine_core=SimpleNamespace(call_utility_async=call_utility_async))
        ledger = VersionLedger(version=0)
        req, cell = _Req("a", 2), RequestVersions()
        request_states["a"] = req
        ledger.on_register(req)
        cell.add(req, None, 0)  # the HTTP request's hold on its state
        outputs: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        present_at_commit: list[bool] = []

        async def output_handler() -> None:  # AsyncLLM.output_handler: one token per output here
            while True:
                rid, finished = await outputs.get()
                request_states[rid].n += 1
                if finished:
                    request_states.pop(rid)  # OutputProcessor._finish_request
                outputs.task_done()

        handler = asyncio.create_task(output_handler())
        swap = asyncio.create_task(orchestrator._set_version(
            SimpleNamespace(ledger=ledger, engine=engine), 1, "titan_set_weight_version", 1))
        await asyncio.sleep(0)
        assert utility and not handler.done()
        # one run of the socket task: step k (token 2, old weights), the utility's answer (the engine held
        # "a" with 3 tokens), step k+1 (token 3, new weights, finishes "a")
        outputs.put_nowait(("a", False))
        utility[0].set_result({"counts": {"a": 3}, "in_flight": 1, "resalted": 0})
        outputs.put_nowait(("a", True))
        await outputs.join()
        present_at_commit.append("a" in request_states)
        await swap
        handler.cancel()
        assert ledger.version == 1
        return cell, present_at_commit, weakref.ref(req)

    cell, present, ref = asyncio.run(run())
    assert present == [False]  # the race happened: the state was gone from request_states before the commit
    assert cell.spans(0) == [[0, 0, 3], [1, 3, 4]]
    del cell
    gc.collect()
    assert ref() is None  # the ledger does not keep finished requests alive
