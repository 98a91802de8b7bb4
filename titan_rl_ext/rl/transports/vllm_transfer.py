"""``titan_gloo`` / ``titan_gloo_relay``: our trainer pushes through vLLM's weight-transfer calls (issue 43).

The generators run the ``titan_gloo`` engine (``vllm_titan_plugin.swap.transfer_engine``; ``titan_nccl`` on
GPU). Per generator the pusher makes vLLM's calls on its OpenAI port, each signed with the push token like
every other call that changes a server (``WeightPusher.dev_post``):

- ``/init_weight_transfer_engine`` when the set of generators (or one's boot) changed since the last group
  was built: the trainer hosts one rendezvous store (``TCPStore``) for the run and builds every group on it
  under a fresh key prefix (``collective.process_group``), so a rebuild needs no new port;
- per version ``/start_weight_update``, one ``/update_weights`` per bucket (names, dtypes, shapes; the bucket's
  bytes go by one broadcast from rank 0 while the call runs), then ``/finish_weight_update`` with the version,
  which commits through the server's ``locked_swap`` (all-or-none, version tags, re-salted prefix cache) in the
  push's mode: ``?mode=keep|recompute&pause=0|1`` on the finish, as on the HTTP push route
  (``vllm_titan_plugin.swap.transfer_commit``).

All-or-none as on the HTTP path: a generator changes weights only at its finish; a push that fails before
the finishes (a generator dies mid-broadcast, the trainer raises) commits nowhere, and every generator keeps
its old weights. A member lost mid-broadcast breaks the collective for all, so the group is rebuilt without
the generators that no longer answer and the version is sent again once; those, and any generator that
refused, get a failed ``PushResult`` (``WeightPushError`` from ``push``, ``out`` in a fleet), exactly what the
HTTP path reports. A generator that comes back (a new boot id) is put in the next group and gets the next
version.

``titan_gloo`` puts every generator in the trainer's group (the trainer's link carries one copy per
generator at most, by gloo's broadcast). ``titan_gloo_relay`` puts one generator per host (the lead) in it;
the lead passes each buffer on to the host's other generators through a host-local group
(``vllm_titan_plugin.swap.relay``), so the network carries one model per host per version. Needs torch only
(not vLLM) on the trainer.

Options (``WeightPusher(transport_options=...)``): ``address`` (where generators reach the trainer's store;
default: 127.0.0.1 when every generator is local, else this host's address on the route to them), ``port``
(the store's port, the one port the trainer opens; 0: an ephemeral one), ``bucket_bytes`` (per
``update_weights``; default 256 MiB), ``timeout_s`` (bound on each collective, default 60), ``engine_backend``
(the servers' ``--weight-transfer-config`` backend: ``titan_gloo``, or ``titan_nccl`` whose group is NCCL and
whose tensors must be on the trainer's GPU). Generators with one worker each (no tensor parallelism).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_rl_ext.rl.transports import register_transport
from titan_rl_ext.rl.transports.base import Link, PushResult, Staged
from titan_rl_ext.wire import collective

logger = logging.getLogger(__name__)

NAME = "titan_gloo"
RELAY_NAME = "titan_gloo_relay"
ENGINE_BACKENDS = {"titan_gloo": "gloo", "titan_nccl": "nccl"}  # server engine -> the group's torch backend
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 60.0
OPTION_KEYS = ("address", "port", "bucket_bytes", "timeout_s", "engine_backend")
INIT, START, UPDATE, FINISH = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                               "/finish_weight_update")


class TransferFailed(RuntimeError):
    """The collective part of a push failed: nothing was committed anywhere. ``refused``: the generators whose
    own call failed (url -> their answer), when the failure is theirs."""

    def __init__(self, message: str, refused: dict[str, PushResult] | None = None) -> None:
        super().__init__(message)
        self.refused = refused or {}


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]
    nbytes: int

    def info(self) -> dict[str, Any]:
        return {"names": self.names, "dtype_names": [str(t.dtype).removeprefix("torch.") for t in self.tensors],
                "shapes": [list(t.shape) for t in self.tensors], "packed": True, "name_format": "titan"}


@dataclass
class Topology:
    """Who is in which group for one build: ``leads`` in the trainer's group (rank = index + 1), and per
    lead the followers it relays to (empty without the relay)."""

    boots: dict[str, str]  # member url -> boot id at the build
    leads: list[str]
    followers: dict[str, list[str]] = field(default_factory=dict)

    def init_infos(self, address: str, port: int, prefix: str, timeout_s: float) -> dict[str, dict[str, Any]]:
        common = {"master_address": address, "master_port": port, "timeout_s": timeout_s, "group_name": f"{prefix}/net"}
        infos: dict[str, dict[str, Any]] = {}
        for i, lead in enumerate(self.leads):
            infos[lead] = {**common, "rank_offset": i + 1, "world_size": len(self.leads) + 1}
            if rest := self.followers.get(lead):
                host = {"relay_group": f"{prefix}/host{i}", "relay_size": len(rest) + 1}
                infos[lead].update(host, relay_rank=0)
                for j, f in enumerate(rest, start=1):
                    infos[f] = {**common, **host, "relay_rank": j}
        return infos


def _host(url: str) -> str:
    return urllib.parse.urlsplit(url).hostname or "localhost"


def _local_address(urls: Sequence[str]) -> str:
    """This host's address as the generators see it: loopback when they all run here, else the source
    address of the route to the first remote one (no packet is sent: a UDP socket only picks a route)."""
    import socket

    remote = [h for h in map(_host, urls) if h not in ("localhost", "127.0.0.1", "::1")]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        return str(s.getsockname()[0])


class VllmTransferTransport:
    """Broadcast pushes through vLLM's weight-transfer API (module docstring). ``push_all`` does the whole
    push; ``stage``/``commit``/``abort`` exist for the ``WeightTransport`` protocol, ``send`` refuses (a
    broadcast reaches every generator at once, never one by one)."""

    relay = False

    def __init__(self, link: Link) -> None:
        for need in ("dev_post", "boot_id"):
            if not callable(getattr(link, need, None)):
                raise TypeError(f"{type(self).__name__} needs a link with {need}() (a WeightPusher)")
        self.link: Any = link
        opts = self.check_options(getattr(link, "transport_options", None) or {})
        # a subclass's options may lack the store's keys (``titan_ipc`` has no group): their defaults then
        self.address: str | None = opts.get("address")
        self.port: int = opts.get("port", 0)
        self.bucket_bytes: int = opts["bucket_bytes"]
        self.timeout_s: float = opts["timeout_s"]
        self.backend = ENGINE_BACKENDS[opts.get("engine_backend", NAME)]
        self._run = secrets.token_hex(4)  # key prefixes of this trainer's groups on its store
        self._builds = 0
        self._store: Any = None
        self._group: Any = None
        self._topology: Topology | None = None
        self._building: dict[str, str] = {}
        self._opened: list[str] = []  # members with an update session opened by the push in progress
        self._lock = threading.Lock()  # one push at a time: the group carries one version's bytes

    @staticmethod
    def check_options(opts: Mapping[str, Any]) -> dict[str, Any]:
        """The options (module docstring) checked and with their defaults filled in; ``ValueError`` naming the
        key and the value refused. Static: the trainer checks ``--rl.weight_transport_options`` at start-up
        with it, long before a transport exists (``transports.check_transport_options``)."""
        if not isinstance(opts, Mapping):
            raise ValueError(f"{NAME} options must be a JSON object, got {type(opts).__name__}")
        if unknown := sorted(set(opts) - set(OPTION_KEYS)):
            raise ValueError(f"{NAME}: unknown transport options {unknown}; it takes {list(OPTION_KEYS)}")

        def bad(key: str, want: str) -> ValueError:
            return ValueError(f"{NAME} transport option {key!r} must be {want}, got {opts[key]!r}")

        def integer(key: str, default: int, lo: int, hi: int | None, want: str) -> int:
            v = opts.get(key, default)
            # JSON true is an int to Python: refused, as a port or a size of True is a mistake
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                raise bad(key, want)
            return v

        address = opts.get("address")
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise bad("address", "a host name or IP address the generators can reach")
        timeout = opts.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise bad("timeout_s", "a number of seconds in (0, 3600]")
        engine_backend = opts.get("engine_backend", "titan_gloo")
        if engine_backend not in ENGINE_BACKENDS:
            raise bad("engine_backend", f"one of {sorted(ENGINE_BACKENDS)} (the servers' --weight-transfer-config "
                                        f"backend)")
        return {"address": address, "port": integer("port", 0, 0, 65535, "an integer in [0, 65535] (0: ephemeral)"),
                "bucket_bytes": integer("bucket_bytes", DEFAULT_BUCKET_BYTES, 1, None, "an integer >= 1"),
                "timeout_s": float(timeout), "engine_backend": engine_backend}

    @staticmethod
    def server_engine(opts: Mapping[str, Any]) -> str:
        """The servers' ``--weight-transfer-config`` backend this transport pushes into (``opts``: checked ones);
        a server the run spawns gets it (``transports.spawned_server``)."""
        return str(opts.get("engine_backend", NAME))

    # -- the WeightTransport protocol (``WeightPusher.push_each`` calls ``push_all`` instead) ---------------
    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> Staged:
        return Staged(b"", hold=self.buckets(state_dict))

    def send(self, staged: Staged, url: str, params: Mapping[str, str]) -> PushResult:
        raise NotImplementedError(f"{self.name} pushes to every generator at once: use push_all")

    def commit(self, staged: Staged) -> None:
        staged.hold = None

    def abort(self, staged: Staged) -> None:
        staged.hold = None

    # -- the push -----------------------------------------------------------------------------------------
    def buckets(self, state_dict: Mapping[str, torch.Tensor]) -> list[Bucket]:
        """The state dict in ``update_weights``-sized buckets, in its order (a tensor larger than a bucket
        travels alone)."""
        out: list[Bucket] = []
        cur = Bucket([], [], 0)
        for name in state_dict:
            t = state_dict[name].detach()
            n = t.numel() * t.element_size()
            if cur.names and cur.nbytes + n > self.bucket_bytes:
                out.append(cur)
                cur = Bucket([], [], 0)
            cur.names.append(name)
            cur.tensors.append(t)
            cur.nbytes += n
        if cur.names:
            out.append(cur)
        return out

    def push_all(self, urls: Sequence[str], state_dict: Mapping[str, torch.Tensor], params: Mapping[str, str],
                 on_result: Callable[[PushResult], None] | None = None) -> list[PushResult]:
        """Push one version to every generator of ``urls``; one ``PushResult`` each, in ``urls`` order.
        Raises only what the caller's state dict raises (after closing the group: nothing is committed)."""
        version = int(params["version"])
        # the commit's mode rides on each finish's query (the server reads it as the HTTP push route does)
        commit_query = {k: params[k] for k in ("mode", "pause") if k in params}
        with self._lock:
            results: dict[str, PushResult] = {}
            self._opened = []
            try:
                buckets = self.buckets(state_dict)
                self._push(list(urls), buckets, version, results, commit_query)
            except BaseException:
                self._close()  # the generators' receives fail now; none of them commits
                if self._opened:
                    self._end_sessions(self._opened)  # best effort: the next push would close them anyway
                raise
        ordered = []
        for url in urls:
            r = results.get(url) or {"url": url, "ok": False, "status": None, "error": "not pushed"}
            if on_result is not None:
                on_result(r)
            ordered.append(r)
        return ordered

    def _push(self, urls: list[str], buckets: list[Bucket], version: int, results: dict[str, PushResult],
              commit_query: Mapping[str, str] | None = None) -> None:
        nbytes = sum(b.nbytes for b in buckets)
        for attempt in range(2):
            boots = self._boots(urls)
            for url in urls:
                if boots[url] is None:
                    results[url] = {"url": url, "ok": False, "status": None,
                                    "error": "unreachable: no boot id from its version route"}
            live = [u for u in urls if boots[u] is not None and u not in results]
            if not live:
                return
            t0 = time.perf_counter()
            try:
                self._ensure_group({u: boots[u] for u in live})  # type: ignore[misc]
                t1 = time.perf_counter()
                self._transfer(live, buckets)
            except TransferFailed as e:
                self._close()
                still = self._boots(live)
                self._end_sessions([u for u in live if still[u] == boots[u]])  # a member may have all of it staged
                # the ones that died (a new boot, or none) or refused their call: the others take the version
                # without them, as they would have over HTTP
                lost = {u for u in live if still[u] != boots[u]} | set(e.refused)
                if attempt == 0 and lost and len(lost) < len(live):
                    logger.warning("%s push v%d: %d generator(s) lost or refusing mid-transfer (%s); sending again "
                                   "without them", NAME, version, len(lost), ", ".join(sorted(lost)))
                    for u in lost:
                        results[u] = e.refused.get(u) or {"url": u, "ok": False, "status": None,
                                                          "error": f"lost mid-transfer: {e}"[:2000]}
                    continue
                for u in live:
                    results[u] = {"url": u, "ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}
                return
            timing = {"init_seconds": t1 - t0, "transfer_seconds": time.perf_counter() - t1}
            self._finish(live, boots, version, len(buckets), nbytes, timing, results, commit_query)
            return

    def _boots(self, urls: Sequence[str]) -> dict[str, str | None]:
        with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
            return dict(zip(urls, pool.map(self.link.boot_id, urls)))

    def _topology_of(self, boots: dict[str, str]) -> Topology:
        if not self.relay:
            return Topology(dict(boots), list(boots))
        by_host: dict[str, list[str]] = {}
        for u in boots:
            by_host.setdefault(_host(u), []).append(u)
        return Topology(dict(boots), [m[0] for m in by_host.values()], {m[0]: m[1:] for m in by_host.values()})

    def _ensure_group(self, boots: dict[str, str]) -> None:
        """The groups for these generators at these boots: kept from the last push, else built now (every
        member's ``init_weight_transfer_engine`` runs while the trainer joins)."""
        topo = self._topology_of(boots)
        if self._group is not None and self._topology == topo:
            return
        self._close()
        if self._store is None:
            from datetime import timedelta

            from torch.distributed import TCPStore

            self.address = self.address or _local_address(list(boots))
            # the trainer's one listening port for weight transfer (the operator's ``port``; gloo's pair
            # transport adds ephemeral ones per group, as any gloo group does)
            self._store = TCPStore(self.address, self.port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.timeout_s), multi_tenant=True)
        self._builds += 1
        self._building = topo.boots  # the init calls are signed for these boots
        prefix = f"titan/{self._run}/{self._builds}"
        infos = topo.init_infos(self.address or "127.0.0.1", int(self._store.port), prefix, self.timeout_s)
        answers = self._call_all(INIT, {u: {"init_info": infos[u]} for u in infos})
        try:
            group = collective.process_group(self._store, f"{prefix}/net", 0, len(topo.leads) + 1, self.backend, self.timeout_s)
        except Exception as e:
            raise TransferFailed(f"building the trainer's group: {e}") from e
        finally:
            got = answers()
        self._group, self._topology = group, topo
        self._check(got, INIT)

    def _call_all(self, path: str, bodies: Mapping[str, dict[str, Any] | None],
                  params: Mapping[str, str] | None = None) -> Callable[[], dict[str, PushResult]]:
        """POST ``path`` to every generator at once, in threads (the calls that receive block until the
        broadcast is over, so they run beside it); the returned callable waits for every answer."""
        pool = ThreadPoolExecutor(max_workers=max(1, len(bodies)))
        boots = self._topology.boots if self._topology is not None else self._building
        futures = {u: pool.submit(self.link.dev_post, u, path, body, boots.get(u), params)
                   for u, body in bodies.items()}
        pool.shutdown(wait=False)

        def answers() -> dict[str, PushResult]:
            return {u: f.result() for u, f in futures.items()}

        return answers

    @staticmethod
    def _check(answers: dict[str, PushResult], path: str) -> None:
        if bad := {u: r for u, r in answers.items() if not r["ok"]}:
            raise TransferFailed("; ".join(f"{u} {path}: HTTP {r['status']} {str(r['error'])[:300]}"
                                           for u, r in bad.items()), bad)

    def _start(self, live: list[str]) -> None:
        """``start_weight_update`` on every member. vLLM's worker refuses it while an earlier session is open
        (a transfer that failed after a member had received everything, or a trainer that died before its
        finish): such a member's session is closed first (``_end_sessions``) and asked once more."""
        self._opened = list(live)
        got = self._call_all(START, {u: None for u in live})()
        if stuck := [u for u, r in got.items() if not r["ok"] and r["status"] is not None]:
            self._end_sessions(stuck)
            got.update(self._call_all(START, {u: None for u in stuck})())
        self._check(got, START)

    def _end_sessions(self, urls: list[str]) -> None:
        """Close whatever update session ``urls`` have open, committing nothing: a ``finish_weight_update``
        without a ``weight_version`` is refused (400) before any commit, and the titan server closes the
        workers' session and drops their staging whatever the finish answered (``swap.transfer_commit``)."""
        self._call_all(FINISH, {u: {} for u in urls})()

    def _transfer(self, live: list[str], buckets: list[Bucket]) -> None:
        self._start(live)
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        for bucket in buckets:
            answers = self._call_all(UPDATE, {u: {"update_info": bucket.info()} for u in live})
            buf = collective.pack([t.to(device) for t in bucket.tensors])
            try:
                self._group.broadcast(buf, 0).wait()
            except Exception as e:
                raise TransferFailed(f"broadcast: {e}") from e
            finally:
                got = answers()
            self._check(got, UPDATE)

    def _finish(self, live: list[str], boots: Mapping[str, str | None], version: int, buckets: int, nbytes: int,
                timing: dict[str, float], results: dict[str, PushResult],
                commit_query: Mapping[str, str] | None = None) -> None:
        """Every member commits (or refuses) on its own, in ``commit_query``'s mode: one member's refusal does not
        undo another's."""
        t0 = time.perf_counter()
        got = self._call_all(FINISH, {u: {"weight_version": str(version)} for u in live}, commit_query)()
        timing["finish_seconds"] = time.perf_counter() - t0  # the slowest member's commit
        for u, r in got.items():
            if r["ok"]:
                r["response"] = {"version": version, "boot_id": boots[u], "transport": self.name,
                                 "mode": (commit_query or {}).get("mode", "keep"),
                                 "num_buckets": buckets, "bytes": nbytes, **timing}
            results[u] = r

    @property
    def name(self) -> str:
        return RELAY_NAME if self.relay else NAME

    def _close(self) -> None:
        """Drop the trainer's group (its members' pending receives fail now); the next push builds anew."""
        group, self._group, self._topology = self._group, None, None
        if group is not None:
            collective.close_group(group)

    def close(self) -> None:
        """Release the group and the store (the generators' groups fail on their next use and are rebuilt)."""
        with self._lock:
            self._close()
            self._store = None


@register_transport(NAME)
class TitanGlooTransport(VllmTransferTransport):
    relay = False


@register_transport(RELAY_NAME)
class TitanGlooRelayTransport(VllmTransferTransport):
    relay = True
