"""What every token-level policy-gradient loss on flat packed tensors shares: the driver (``PolicyLoss``:
input checks, masking, mismatch correction, KL term, aggregation), the PPO clip surrogate, and torchtitan's
``Configurable`` pattern. The losses themselves are the other modules of this package (``grpo``, ``dapo``,
``dppo``), one each, registered by name.

Every loss is a configurable component in torchtitan's style (a nested
``@dataclass(kw_only=True, slots=True) class Config`` whose ``build()`` returns the loss object),
written against torch alone so that this package imports without torchtitan.

Inputs (all ``[T]``, the packed token stream of ``token_logprobs``; prompt and completion tokens of
each sequence back to back):

* ``lp_new_T``  log pi_theta(y_t | ...) from the trainer, requires grad. May hold NaN at positions
  outside the loss mask (``token_logprobs`` gives NaN at each sequence's first token).
* ``lp_old_T``  log pi_old(y_t | ...): the behaviour policy of the PPO ratio -- either the
  generator's logprobs or the trainer's recompute with the pre-update weights. Treated as constant.
* ``adv_T``     advantage per token (a sequence's advantage broadcast to its tokens). Constant.
* ``mask_T``    bool, True on the tokens that get a loss (completion tokens only).
* ``lp_gen_T``  optional generator (inference engine) logprobs, used only by the train/inference
  mismatch correction, which needs ``lp_old_T`` to be the *trainer's* recompute.

Everything outside ``mask_T`` is replaced by 0 with ``torch.where`` *before* any arithmetic, so NaN
or garbage there changes neither the loss nor the gradient (``x * 0`` would keep a NaN).

Notation below: ``r_t = exp(lp_new_t - lp_old_t)``, ``sg`` = stop-gradient (``.detach()``),
``M`` = the set of tokens with ``mask_T`` True.

Per-token surrogates ``l_t`` (the loss is to be minimised; each loss's module gives its own), the shared one:

* PPO clip (``ppo_clip_token_loss``; GRPO with ``eps_low = eps_high = eps``; DAPO with ``eps_low=0.2,
  eps_high=0.28``)::

      l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

  implemented as ``-A_t * where(clipped_t, sg(clip(r_t)), r_t)`` with
  ``clipped_t = (A_t > 0 and r_t > 1 + eps_high) or (A_t < 0 and r_t < 1 - eps_low)``: the same
  value as the min form; the gradient is zero strictly beyond a boundary and ``-A_t r_t
  grad(lp_new_t)`` at or inside it. Spelling the clipped set out (rather than relying on how
  ``torch.minimum`` splits ties and ``clamp`` treats its bounds) makes that boundary convention
  explicit, and the same set feeds the clip-fraction metrics.

Train/inference mismatch correction (any loss, off by default; see ``MismatchCorrection``), with
``rho_t = exp(lp_old_t - lp_gen_t)``::

      l_t <- keep_t * tis_t * l_t,   tis_t = sg(min(rho_t, C_tis)),
      keep_t = not (|lp_old_t - lp_gen_t| > tau) and not (rho_t > C_mask or rho_t < 1 / C_mask)

Optional KL penalty to a reference policy (``kl_coef``, default 0 = KL-free), the k3 estimator::

      l_t <- l_t + kl_coef * (exp(lp_ref_t - lp_new_t) - (lp_ref_t - lp_new_t) - 1)

Aggregation (mismatch-dropped tokens still count in the denominators: dropping acts as weight 0,
so a caller's all-reduced token count needs no knowledge of the correction):

* ``"seq_mean"`` (GRPO's default): ``L = (1 / N_seq) sum_i (1 / |M_i|) sum_{t in M_i} l_t`` -- the
  mean over each sequence's loss tokens, then the mean over sequences with at least one loss
  token; ``N_seq`` is that count, or ``num_global_seqs`` when given (for data parallelism).
* ``"token_mean"`` (DAPO's and DPPO's default): ``L = sum_{t in M} l_t / N_tok`` with
  ``N_tok = num_global_valid_tokens`` -- the caller's all-reduced count of loss tokens over every rank
  and micro-batch of the optimizer step -- or the local ``|M|`` when not given. Then the per-rank
  losses are partial sums (torchtitan's convention for ``loss / global_valid_tokens``): the sum over
  ranks equals the global token mean, so the gradient reduction must *sum* over ranks (multiply by
  the data-parallel degree if it averages).

Each loss returns ``(loss, metrics)``; metrics are detached 0-dim tensors (no host sync), means over
the local loss tokens: ``clip_frac_low``/``clip_frac_high`` (tokens whose gradient the trust region
zeroed, for A<0 / A>0), ``ratio_mean``, ``approx_kl`` (k3 estimate of KL(pi_old || pi_new)),
``masked_frac`` (dropped by the mismatch correction), ``tis_weight_mean``, ``num_tokens`` (local
count); when given the inputs also ``mismatch_kl`` (k3 of KL(generator || trainer)),
``tis_clip_frac`` (TIS on), ``kl_ref`` (``lp_ref_T`` given), ``tv_mean`` (DPPO: mean |dp_t|).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch

__all__ = ["Aggregation", "Configurable", "Metrics", "MismatchCorrection", "PolicyLoss", "config_to_dict", "masked_mean",
           "ppo_clip_token_loss"]

Metrics = dict[str, torch.Tensor]
Aggregation = Literal["seq_mean", "token_mean"]


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass as plain data (nested configs as dicts): what a run logs as its settings."""
    return {f.name: (v.to_dict() if hasattr(v := getattr(config, f.name), "to_dict") else v) for f in fields(config)}


class Configurable:
    """torchtitan's ``Configurable`` pattern (``torchtitan.config.Configurable``) without torchtitan.

    A subclass defines a nested ``@dataclass(kw_only=True, slots=True) class Config(<parent>.Config)``
    and an ``__init__(self, config)``; ``Config.build()`` is wired to construct the subclass from a
    copy of the config, exactly like torchtitan's, so a later edit of the config does not leak
    into built objects.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        _owner: ClassVar[type | None] = None

        def build(self, **kwargs: Any) -> Any:
            owner = type(self)._owner
            if owner is None:
                raise NotImplementedError(
                    f"{type(self).__name__} has no owner class; define Config inside a Configurable"
                )
            overlap = {f.name for f in fields(self)} & kwargs.keys()
            if overlap:
                raise ValueError(f"build() kwargs {sorted(overlap)} overlap with config fields")
            return owner(config=dataclasses.replace(self), **kwargs)

        def to_dict(self) -> dict[str, Any]:
            return config_to_dict(self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cfg = cls.__dict__.get("Config")
        if cfg is None:
            return
        # the same enforcement torchtitan applies, so these configs drop into torchtitan's tree as-is
        if "__slots__" not in cfg.__dict__:
            raise TypeError(f"{cls.__name__}.Config must use @dataclass(kw_only=True, slots=True)")
        for f in fields(cfg):
            if f.init and not f.kw_only:
                raise TypeError(f"{cls.__name__}.Config field {f.name!r} must be keyword-only")
        cfg._owner = cls


# ----------------------------------------------------------------------------------------------
# helpers


def masked_mean(x_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    # metrics only: zero when there are no loss tokens instead of NaN
    return (torch.where(mask_T, x_T, 0).sum() / mask_T.sum().clamp(min=1)).detach().float()


def _sanitize(x_T: torch.Tensor, mask_T: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # where (not multiply): NaN outside the mask must not reach the forward value or the gradient
    return torch.where(mask_T, x_T.to(dtype), 0)


def _check_1d(name: str, x: torch.Tensor | None, T: int) -> None:
    if x is not None and tuple(x.shape) != (T,):
        raise ValueError(f"{name} must have shape [T]=[{T}], got {tuple(x.shape)}")


def _as_count(n: int | float | torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(n, torch.Tensor):
        # a tensor from an all-reduce stays on device (no sync); clamp guards an all-empty step
        return n.detach().to(device=like.device, dtype=like.dtype).reshape(()).clamp(min=1)
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {n}")
    return torch.tensor(float(n), dtype=like.dtype, device=like.device)


# ----------------------------------------------------------------------------------------------
# train/inference mismatch correction


class MismatchCorrection(Configurable):
    """Importance corrections for the gap between the generator's and the trainer's probabilities.

    With ``rho_t = exp(lp_old_t - lp_gen_t)`` (trainer recompute over generator, same weights):

    * truncated IS (``tis=True``): ``weight_t = sg(min(rho_t, tis_cap))``, default cap 2.0;
    * token masking: drop token t when ``|lp_old_t - lp_gen_t| > mask_max_abs_log_ratio`` or when
      ``rho_t`` lies outside ``[1 / mask_ratio_cap, mask_ratio_cap]``. The two tests describe the same
      band for ``tau = ln C``; both are offered because recipes quote one or the other.

    All off by default. Dropped tokens get weight 0 but keep counting in the loss denominators.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        tis: bool = False
        """Multiply each token's loss by sg(min(rho_t, tis_cap))."""
        tis_cap: float = 2.0
        mask_max_abs_log_ratio: float | None = None
        """Drop tokens with |lp_old - lp_gen| above this (None: off)."""
        mask_ratio_cap: float | None = None
        """Drop tokens with rho outside [1/C, C] (None: off)."""

    def __init__(self, config: Config) -> None:
        if config.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {config.tis_cap}")
        if config.mask_max_abs_log_ratio is not None and config.mask_max_abs_log_ratio < 0:
            raise ValueError(f"mask_max_abs_log_ratio must be >= 0, got {config.mask_max_abs_log_ratio}")
        if config.mask_ratio_cap is not None and config.mask_ratio_cap < 1:
            raise ValueError(f"mask_ratio_cap must be >= 1, got {config.mask_ratio_cap}")
        self.config = config

    @property
    def enabled(self) -> bool:
        c = self.config
        return c.tis or c.mask_max_abs_log_ratio is not None or c.mask_ratio_cap is not None

    def __call__(
        self, mask_T: torch.Tensor, lp_old_T: torch.Tensor, lp_gen_T: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """Returns ``(weight_T, keep_T, metrics)``: detached per-token weights (1 where TIS is off)
        and the loss mask with mismatched tokens dropped. Inputs outside ``mask_T`` are ignored."""
        c = self.config
        dtype = torch.promote_types(lp_old_T.dtype, torch.float32)
        zeros_T = torch.zeros(mask_T.shape, dtype=dtype, device=mask_T.device)
        metrics: Metrics = {
            "masked_frac": masked_mean(zeros_T, mask_T),
            "tis_weight_mean": masked_mean(zeros_T + 1, mask_T),
        }
        if lp_gen_T is None:
            if self.enabled:
                raise ValueError("the mismatch correction is on but no generator logprobs (lp_gen_T) were given")
            return zeros_T + 1, mask_T, metrics
        with torch.no_grad():
            log_rho_T = _sanitize(lp_old_T.detach(), mask_T, dtype) - _sanitize(lp_gen_T.detach(), mask_T, dtype)
            rho_T = torch.exp(log_rho_T)
            # k3 estimate of KL(generator || trainer) on the sampled tokens: reported whenever the
            # generator's logprobs are given, so the gap is visible before turning a correction on
            metrics["mismatch_kl"] = masked_mean(rho_T - 1 - log_rho_T, mask_T)
            weight_T = zeros_T + 1
            if c.tis:
                # min in log space: exp never overflows however far apart the two sides are
                weight_T = torch.exp(log_rho_T.clamp(max=math.log(c.tis_cap)))
                metrics["tis_weight_mean"] = masked_mean(weight_T, mask_T)
                metrics["tis_clip_frac"] = masked_mean((rho_T > c.tis_cap).to(dtype), mask_T)
            drop_T = torch.zeros_like(mask_T)
            if c.mask_max_abs_log_ratio is not None:
                drop_T |= log_rho_T.abs() > c.mask_max_abs_log_ratio
            if c.mask_ratio_cap is not None:
                drop_T |= (rho_T > c.mask_ratio_cap) | (rho_T < 1.0 / c.mask_ratio_cap)
            keep_T = mask_T & ~drop_T
            metrics["masked_frac"] = masked_mean(drop_T.to(dtype), mask_T)
        return weight_T, keep_T, metrics


# ----------------------------------------------------------------------------------------------
# losses


class PolicyLoss(Configurable):
    """Shared driver: input checks, masking, mismatch correction, KL term, aggregation.

    Subclasses implement ``token_loss`` on already-sanitised inputs (zeros outside ``mask_T``).
    Call signature::

        loss, metrics = loss_fn(lp_new_T, lp_old_T, adv_T, mask_T, *, cu_seqlens=..., lp_gen_T=...,
                                lp_ref_T=..., num_global_valid_tokens=..., num_global_seqs=...)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        aggregation: Aggregation = "token_mean"
        """"seq_mean": mean over each sequence's loss tokens, then over sequences (needs cu_seqlens);
        "token_mean": sum over loss tokens / num_global_valid_tokens (local count if not given)."""
        kl_coef: float = 0.0
        """Weight of the k3 KL(pi_new || pi_ref) penalty; 0 = KL-free (no reference model needed)."""
        mismatch: MismatchCorrection.Config = field(default_factory=MismatchCorrection.Config)

    def __init__(self, config: Config) -> None:
        if config.aggregation not in ("seq_mean", "token_mean"):
            raise ValueError(f"aggregation must be 'seq_mean' or 'token_mean', got {config.aggregation!r}")
        if config.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {config.kl_coef}")
        self.config = config
        self.mismatch: MismatchCorrection = config.mismatch.build()

    def token_loss(
        self, lp_new_T: torch.Tensor, lp_old_T: torch.Tensor, adv_T: torch.Tensor, mask_T: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        """Per-token surrogate ``l_T`` (to minimise) and loss-specific metrics."""
        raise NotImplementedError

    def __call__(
        self,
        lp_new_T: torch.Tensor,
        lp_old_T: torch.Tensor,
        adv_T: torch.Tensor,
        mask_T: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        lp_gen_T: torch.Tensor | None = None,
        lp_ref_T: torch.Tensor | None = None,
        num_global_valid_tokens: int | torch.Tensor | None = None,
        num_global_seqs: int | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        if lp_new_T.dim() != 1:
            raise ValueError(f"lp_new_T must be 1-D [T], got shape {tuple(lp_new_T.shape)}")
        T = lp_new_T.shape[0]
        for name, x in (("lp_old_T", lp_old_T), ("adv_T", adv_T), ("mask_T", mask_T),
                        ("lp_gen_T", lp_gen_T), ("lp_ref_T", lp_ref_T)):
            _check_1d(name, x, T)
        if mask_T.dtype != torch.bool:
            raise TypeError(f"mask_T must be bool, got {mask_T.dtype}")
        cfg = self.config
        if cfg.kl_coef > 0 and lp_ref_T is None:
            raise ValueError("kl_coef > 0 needs reference-policy logprobs (lp_ref_T)")

        dtype = torch.promote_types(lp_new_T.dtype, torch.float32)
        lp_new_T = _sanitize(lp_new_T, mask_T, dtype)
        lp_old_T = _sanitize(lp_old_T.detach(), mask_T, dtype)
        adv_T = _sanitize(adv_T.detach(), mask_T, dtype)

        pg_T, metrics = self.token_loss(lp_new_T, lp_old_T, adv_T, mask_T)
        weight_T, keep_T, mm_metrics = self.mismatch(mask_T, lp_old_T, lp_gen_T)
        metrics.update(mm_metrics)
        loss_T = torch.where(keep_T, pg_T * weight_T, 0)

        if lp_ref_T is not None:
            d_T = _sanitize(lp_ref_T.detach(), mask_T, dtype) - lp_new_T
            kl_T = torch.exp(d_T) - d_T - 1  # k3 estimator of KL(pi_new || pi_ref), as in GRPO; >= 0
            metrics["kl_ref"] = masked_mean(kl_T.detach(), mask_T)
            if cfg.kl_coef > 0:
                # on every loss token, unweighted by the mismatch correction (it regularises pi_new)
                loss_T = loss_T + cfg.kl_coef * torch.where(mask_T, kl_T, 0)

        with torch.no_grad():
            metrics["ratio_mean"] = masked_mean(torch.exp(lp_new_T - lp_old_T), mask_T)
            log_r_T = lp_new_T - lp_old_T
            metrics["approx_kl"] = masked_mean(torch.exp(log_r_T) - 1 - log_r_T, mask_T)
            metrics["num_tokens"] = mask_T.sum().detach().float()

        loss = self._aggregate(loss_T, mask_T, cu_seqlens, num_global_valid_tokens, num_global_seqs)
        return loss, metrics

    def _aggregate(
        self,
        loss_T: torch.Tensor,
        mask_T: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        num_global_valid_tokens: int | torch.Tensor | None,
        num_global_seqs: int | torch.Tensor | None,
    ) -> torch.Tensor:
        # loss_T is already zero outside the mask (and connected to the graph, so an all-masked
        # batch still backpropagates zeros instead of failing)
        if self.config.aggregation == "token_mean":
            if num_global_seqs is not None:
                raise ValueError(
                    "num_global_seqs is for aggregation='seq_mean'; token_mean takes num_global_valid_tokens"
                )
            if num_global_valid_tokens is None:
                denom = mask_T.sum().to(loss_T.dtype).clamp(min=1)
            else:
                denom = _as_count(num_global_valid_tokens, loss_T, "num_global_valid_tokens")
            return loss_T.sum() / denom

        if num_global_valid_tokens is not None:
            raise ValueError("num_global_valid_tokens is for aggregation='token_mean'; seq_mean takes num_global_seqs")
        if cu_seqlens is None:
            raise ValueError("aggregation='seq_mean' needs cu_seqlens [N+1] (e.g. SeqBatch.cu_seqlens)")
        cu = cu_seqlens.to(device=loss_T.device, dtype=torch.long)
        lengths_N = cu[1:] - cu[:-1]
        N = lengths_N.numel()
        if int(cu[-1]) != loss_T.numel() or int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens spans [{int(cu[0])}, {int(cu[-1])}) but there are {loss_T.numel()} tokens")
        seq_id_T = torch.repeat_interleave(
            torch.arange(N, device=loss_T.device), lengths_N, output_size=loss_T.numel()
        )
        sum_N = loss_T.new_zeros(N).index_add(0, seq_id_T, loss_T)
        cnt_N = loss_T.new_zeros(N).index_add(0, seq_id_T, mask_T.to(loss_T.dtype))
        seq_mean_N = sum_N / cnt_N.clamp(min=1)
        if num_global_seqs is None:
            # sequences without loss tokens (e.g. empty completions) do not dilute the mean
            n_seqs = (cnt_N > 0).sum().to(loss_T.dtype).clamp(min=1)
        else:
            n_seqs = _as_count(num_global_seqs, loss_T, "num_global_seqs")
        return seq_mean_N.sum() / n_seqs


def ppo_clip_token_loss(
    lp_new_T: torch.Tensor, lp_old_T: torch.Tensor, adv_T: torch.Tensor, mask_T: torch.Tensor,
    eps_low: float, eps_high: float,
) -> tuple[torch.Tensor, Metrics]:
    """``l_t = -min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with a gradient that is zero exactly
    when the clip is active (strictly beyond the boundary on the side the advantage pushes)."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    ratio_T = torch.exp(lp_new_T - lp_old_T)
    with torch.no_grad():
        clip_hi_T = (adv_T > 0) & (ratio_T > hi)
        clip_lo_T = (adv_T < 0) & (ratio_T < lo)
    # clipped tokens: constant clip(r) A (the min picks it there); others: r A with its gradient
    ratio_eff_T = torch.where(clip_hi_T | clip_lo_T, ratio_T.detach().clamp(lo, hi), ratio_T)
    pg_T = -adv_T * ratio_eff_T
    metrics = {
        "clip_frac_low": masked_mean(clip_lo_T.float(), mask_T),
        "clip_frac_high": masked_mean(clip_hi_T.float(), mask_T),
    }
    return pg_T, metrics
