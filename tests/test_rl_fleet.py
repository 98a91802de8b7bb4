"""GeneratorFleet / FleetClient logic without servers (the real-server fault matrix is tests/test_fleet.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from titan_rl_ext.rl.fleet import FleetClient, GeneratorFleet
from titan_rl_ext.rl.rollout import Generation, GenerationError, SamplingConfig, versions_from_spans
from titan_rl_ext.rl.weight_sync import WeightPushError


class FakePusher:
    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.answers: dict[str, dict[str, Any]] = {}

    def push_each(self, state_dict: Any, version: int, mode: str = "keep", on_result: Any = None) -> list[dict[str, Any]]:
        return [self.answers.get(u, {"url": u, "ok": True, "status": 200, "response": {"version": version, "boot_id": f"boot-{u}"}})
                for u in self.urls]


def _fleet() -> tuple[GeneratorFleet, FakePusher]:
    p = FakePusher(["a", "b", "c"])
    return GeneratorFleet(p), p  # type: ignore[arg-type]


def _gen(server: str, boot: str, versions: list[int]) -> Generation:
    return Generation(token_ids=list(range(len(versions))), logprobs=[0.0] * len(versions), versions=list(versions),
                      server=server, boot_id=boot)


def test_push_outcome_marks_failures_out_and_brings_them_back() -> None:
    f, p = _fleet()
    out = f.push({}, 1)
    assert out.live == ["a", "b", "c"] and not out.out
    p.answers["b"] = {"url": "b", "ok": False, "status": 503, "error": "busy"}
    out = f.push({}, 2)
    assert out.live == ["a", "c"] and list(out.out) == ["b"] and "HTTP 503" in out.out["b"]
    assert out.metrics() == {"fleet/live": 2.0, "fleet/out": 1.0, "swap/post_s": out.seconds}
    assert f.admit(_gen("b", "boot-b", [1, 1])) is not None  # out of the pool: not even its v1 samples
    del p.answers["b"]
    assert f.push({}, 3).live == ["a", "b", "c"]
    assert f.admit(_gen("b", "boot-b", [1, 3])) is None
    assert f.admit(_gen("b", "boot-b", [2])) is not None  # v2 never reached b: something is off with it
    assert "b" not in f.live()


def test_no_live_generator_raises_and_names_each() -> None:
    f, p = _fleet()
    for u in p.urls:
        p.answers[u] = {"url": u, "ok": False, "status": None, "error": f"ConnectionError {u}"}
    with pytest.raises(WeightPushError, match="no generator serves it.*ConnectionError a.*ConnectionError c"):
        f.push({}, 1)
    assert f.live() == []


def test_a_restarted_server_is_refused_until_pushed() -> None:
    f, p = _fleet()
    f.push({}, 1)
    assert f.admit(_gen("a", "boot-a", [1])) is None
    assert "restarted" in (f.admit(_gen("a", "new-boot", [0])) or "")
    assert f.refused == 1 and "a" not in f.live()
    p.answers["a"] = {"url": "a", "ok": True, "status": 200, "response": {"version": 2, "boot_id": "new-boot"}}
    f.push({}, 2)
    assert f.admit(_gen("a", "new-boot", [2])) is None
    assert f.admit(_gen("a", "new-boot", [1])) is not None  # v1 went to the old process, not this one


class SlowPusher(FakePusher):
    """Answers server by server: each answer waits for ``release[url]`` (the push is in flight meanwhile)."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(urls)
        import threading

        self.release = {u: threading.Event() for u in urls}

    def push_each(self, state_dict: Any, version: int, mode: str = "keep", on_result: Any = None) -> list[dict[str, Any]]:
        out = []
        for u in self.urls:
            assert self.release[u].wait(10)
            r = self.answers.get(u, {"url": u, "ok": True, "status": 200, "response": {"version": version, "boot_id": f"boot-{u}"}})
            if on_result is not None:
                on_result(r)
            out.append(r)
        return out


def test_tokens_of_a_push_in_flight_wait_for_that_servers_answer() -> None:
    """Issue 23, risk 7: a token of the version being pushed is admitted only from a server that answered
    that push. Server a answers at once; b's answer is held back, then b fails the push: b's sample, which
    holds tokens of the pushed version, waits and is then refused (b could hold anything)."""
    import threading

    p = SlowPusher(["a", "b"])
    f = GeneratorFleet(p)  # type: ignore[arg-type]
    f.verify("a", 0, "boot-a")
    f.verify("b", 0, "boot-b")
    clients = {"a": FakeClient("a", "boot-a", 1), "b": FakeClient("b", "boot-b", 1)}
    fc = FleetClient(f, clients, wait_s=10)
    p.answers["b"] = {"url": "b", "ok": False, "status": 500, "error": "copy failed"}
    pushing = threading.Thread(target=lambda: f.push({}, 1))
    pushing.start()
    p.release["a"].set()
    while 1 not in f.members["a"].versions:
        threading.Event().wait(0.01)
    assert f.pending == 1 and not f.awaiting(_gen("a", "boot-a", [0, 1])) and f.awaiting(_gen("b", "boot-b", [0, 1]))
    assert f.admit(_gen("a", "boot-a", [0, 1])) is None  # a answered: its v1 tokens are what was pushed

    async def b_sample() -> tuple[float, str | None]:
        t0 = asyncio.get_running_loop().time()
        gen = _gen("b", "boot-b", [0, 1])
        while fc.fleet.awaiting(gen):
            await asyncio.sleep(0.01)
        return asyncio.get_running_loop().time() - t0, fc.fleet.admit(gen)

    threading.Timer(0.3, p.release["b"].set).start()
    waited, refused = asyncio.run(b_sample())
    pushing.join(10)
    assert waited >= 0.25 and refused is not None and "out of the rollout pool" in refused, (waited, refused)
    assert f.live() == ["a"] and f.pending is None
    # and through the client: b's sample is refused, the request goes to a
    gens = [asyncio.run(fc.generate([1, 2], SAMPLING3)) for _ in range(3)]
    assert {g.server for g in gens} == {"a"}


class FakeClient:
    """``fail``: the server is down (requests and probes refused); ``timeouts``: the next N requests time out
    while the server itself answers its version route (a slow request, not a dead server)."""

    def __init__(self, name: str, boot: str, version: int, fail: bool = False) -> None:
        self.name, self.boot, self.version, self.fail, self.calls = name, boot, version, fail, 0
        self.status: int | None = None
        self.timeouts = 0
        self.dirty: str | None = None

    async def generate(self, prompt_ids: Any, sampling: Any) -> Generation:
        self.calls += 1
        if self.status is not None:
            raise GenerationError(f"HTTP {self.status}", self.status)
        if self.fail:
            raise httpx.ConnectError("refused")
        if self.timeouts:
            self.timeouts -= 1
            raise httpx.ReadTimeout("read timed out")
        return _gen(self.name, self.boot, [self.version] * 3)

    async def server_state(self) -> dict[str, Any] | None:
        return None if self.fail else {"version": self.version, "boot_id": self.boot, "dirty": self.dirty}


def test_fleet_client_retries_elsewhere_and_marks_servers_out() -> None:
    f, _ = _fleet()
    f.push({}, 1)
    clients = {"a": FakeClient("a", "boot-a", 1, fail=True), "b": FakeClient("b", "other", 0),
               "c": FakeClient("c", "boot-c", 1)}
    fc = FleetClient(f, clients, wait_s=1)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=3)
    gens = [asyncio.run(fc.generate([1, 2], sampling)) for _ in range(4)]
    assert {g.server for g in gens} == {"c"} and f.live() == ["c"] and f.refused == 1
    clients["c"].status = 400  # the request's fault: raised, and c stays in the pool
    with pytest.raises(GenerationError, match="HTTP 400"):
        asyncio.run(fc.generate([1, 2], sampling))
    assert f.live() == ["c"]
    clients["c"].status, clients["c"].fail = None, True
    with pytest.raises(GenerationError, match="no (admissible sample|generator in the rollout pool)"):
        asyncio.run(fc.generate([1, 2], sampling))


def test_requests_fail_at_once_when_every_generator_has_exited() -> None:
    """A trainer whose spawned server died does not wait out ``wait_s`` for it: with every member out of the
    pool and known gone, a request fails at once, saying why; a member merely out (no exit known) is
    still waited for."""
    import time

    f, _ = _fleet()
    f.push({}, 1)
    clients = {u: FakeClient(u, f"boot-{u}", 1, fail=True) for u in "abc"}
    gone = {"a": "the vLLM server at a exited (-9)", "b": "the vLLM server at b exited (1)", "c": None}
    fc = FleetClient(f, clients, wait_s=60, probe_every_s=60, exited=lambda u: gone[u])
    with pytest.raises(GenerationError, match="no generator in the rollout pool for 1 s"):
        asyncio.run(FleetClient(f, clients, wait_s=1, probe_every_s=60, exited=lambda u: gone[u]).generate([1, 2], SAMPLING3))
    assert f.live() == []  # c only marked out: waited for, up to wait_s
    gone["c"] = "the vLLM server at c exited (0)"
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match=r"every generator has exited: .*a exited \(-9\).*c exited \(0\)"):
        asyncio.run(fc.generate([1, 2], SAMPLING3))
    assert time.monotonic() - t0 < 5


def test_versions_from_spans_must_tile_the_tokens() -> None:
    assert versions_from_spans([[3, 0, 2], [4, 2, 5]], 5) == [3, 3, 4, 4, 4]
    assert versions_from_spans([], 0) == []
    for bad, n in (([[3, 0, 2]], 3), ([[3, 1, 3]], 3), ([[3, 0, 2], [4, 1, 3]], 3), ([[3, 0]], 0)):
        with pytest.raises(GenerationError):
            versions_from_spans(bad, n)


SAMPLING3 = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=3)


def test_a_read_timeout_is_the_requests_fault_when_the_server_answers() -> None:
    """Issue 23, risk 7: one slow request must not empty the pool. A single generator whose request times
    out, while the same process still answers, stays in; the retry on it succeeds."""
    f = GeneratorFleet(FakePusher(["a"]))  # type: ignore[arg-type]
    f.push({}, 1)
    client = FakeClient("a", "boot-a", 1)
    client.timeouts = 1
    fc = FleetClient(f, {"a": client}, wait_s=1)
    gen = asyncio.run(fc.generate([1, 2], SAMPLING3))
    assert gen.server == "a" and f.live() == ["a"] and client.calls == 2


def test_unreachable_server_is_probed_back_in() -> None:
    f, _ = _fleet()
    f.push({}, 1)
    clients = {u: FakeClient(u, f"boot-{u}", 1) for u in "abc"}
    clients["a"].fail = True
    fc = FleetClient(f, clients, wait_s=1, probe_every_s=0.0)
    for _ in range(3):
        asyncio.run(fc.generate([1, 2], SAMPLING3))
    assert "a" not in f.live() and f.probeable() == ["a"]
    clients["a"].fail = False  # it answers again, same process: back at the next pick
    gens = [asyncio.run(fc.generate([1, 2], SAMPLING3)) for _ in range(6)]
    assert "a" in f.live() and "a" in {g.server for g in gens}


def test_restarted_or_dirty_server_waits_for_a_push() -> None:
    f, p = _fleet()
    f.push({}, 1)
    clients = {u: FakeClient(u, f"boot-{u}", 1) for u in "abc"}
    fc = FleetClient(f, clients, wait_s=1, probe_every_s=0.0)
    clients["a"].timeouts, clients["a"].boot = 1, "new-boot"  # restarted behind the same address
    clients["b"].timeouts, clients["b"].dirty = 1, "push of v2 failed in a worker"
    for _ in range(6):
        asyncio.run(fc.generate([1, 2], SAMPLING3))
    assert f.live() == ["c"] and f.probeable() == []  # neither is probed back: their weights are not v1's
    p.answers["a"] = {"url": "a", "ok": True, "status": 200, "response": {"version": 2, "boot_id": "new-boot"}}
    assert sorted(f.push({}, 2).live) == ["a", "b", "c"]


def test_generator_client_server_state() -> None:
    """The probe the fleet uses: the version route's answer, or None when the server does not give one."""
    from titan_rl_ext.rl.rollout import GeneratorClient

    answers = {"up": httpx.Response(200, json={"version": 3, "boot_id": "b1", "dirty": None}),
               "err": httpx.Response(500, text="boom")}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused")
        return answers[request.url.host]

    async def ask(host: str) -> Any:
        client = GeneratorClient(f"http://{host}", "m", http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        try:
            return await client.server_state()
        finally:
            await client.aclose()

    assert asyncio.run(ask("up")) == {"version": 3, "boot_id": "b1", "dirty": None}
    assert asyncio.run(ask("err")) is None and asyncio.run(ask("down")) is None


def test_generators_must_run_the_trainers_recurrent_gdn_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before BI steps the trainer compares each generator's recurrent GDN kernel (the version route's
    ``gdn_recurrent``) with its own: a mismatch stops the run naming both; a server that does not say passes."""
    from titan_rl_ext.rl.generator_link import check_recurrent_kernels

    monkeypatch.setenv("TITAN_GDN_RECURRENT", "titan")
    check_recurrent_kernels({"http://a": {"version": 0, "gdn_recurrent": "titan"}, "http://b": {"version": 0}})
    with pytest.raises(ValueError, match=r"this trainer runs 'titan', but http://b runs 'fla'.*TITAN_GDN_RECURRENT"):
        check_recurrent_kernels({"http://a": {"gdn_recurrent": "titan"}, "http://b": {"gdn_recurrent": "fla"}})
    monkeypatch.setenv("TITAN_GDN_RECURRENT", "fla")
    with pytest.raises(ValueError, match="http://a runs 'titan'"):
        check_recurrent_kernels({"http://a": {"gdn_recurrent": "titan"}})
    monkeypatch.delenv("TITAN_GDN_RECURRENT")  # the default, titan
    with pytest.raises(ValueError, match="this trainer runs 'titan', but http://a runs 'fla'"):
        check_recurrent_kernels({"http://a": {"gdn_recurrent": "fla"}})
